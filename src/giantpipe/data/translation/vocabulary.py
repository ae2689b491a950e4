"""The shared vocabulary of multilingual translation: one SentencePiece model for every language,
with ``<2xx>`` target-language tokens kept whole, and a corpus encoded with it.

A pair is named "src-tgt" (e.g. "en-xa"). The source starts with the target-language token
``<2tgt>`` and ends with ``</s>``; the decoder reads ``<s> y`` and predicts ``y </s>``. Padding
id is 0.

Example::

    from giantpipe.data.translation.vocabulary import SharedVocabulary, encode_corpus

    vocab = SharedVocabulary.train_or_load(corpus, "run/spm", vocab_size=8000)
    data = encode_corpus(corpus, vocab)                       # {pair: [(src_ids, tgt_ids), ...]}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path

from giantpipe.data.translation.files import split_pair

__all__ = [
    "EncodedCorpus",
    "SharedVocabulary",
    "encode_corpus",
    "fits",
    "lang_token",
]


EncodedCorpus = dict[str, list[tuple[list[int], list[int]]]]


def lang_token(lang: str) -> str:
    """The target-language token prepended to the source, e.g. ``<2de>``."""
    return f"<2{lang}>"


def _texts_by_language(corpus: Mapping[str, Sequence[tuple[str, str]]]) -> dict[str, list[str]]:
    texts: dict[str, list[str]] = {}
    for pair, examples in sorted(corpus.items()):
        src, tgt = split_pair(pair)
        texts.setdefault(src, []).extend(s for s, _ in examples)
        texts.setdefault(tgt, []).extend(t for _, t in examples)
    return texts


class SharedVocabulary:
    """One SentencePiece model for every language, with ``<2xx>`` tokens kept whole.

    Ids: 0 ``<pad>``, 1 ``<unk>``, 2 ``<s>``, 3 ``</s>``, then the ``<2xx>`` symbols.

    Example::

        vocab = SharedVocabulary.train_or_load(corpus, "outputs/run/spm", vocab_size=1000)
        ids = vocab.encode("<2xa> the dog .")       # ids[0] == vocab.lang_id("xa")
        vocab.decode(ids[1:])                       # 'the dog .'
    """

    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    def __init__(self, model_file: str | Path) -> None:
        import sentencepiece as spm

        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.model_file))

    @classmethod
    def train_or_load(
        cls,
        corpus: Mapping[str, Sequence[tuple[str, str]]],
        model_dir: str | Path,
        *,
        vocab_size: int = 8000,
        sample_per_language: int = 100_000,
        model_type: str = "unigram",
        seed: int = 0,
    ) -> SharedVocabulary:
        """Load ``model_dir/spm.model`` if it exists (a resumed run), else train and save it.

        Training reads up to ``sample_per_language`` random sentences of every language, so
        low-resource languages are not drowned by large ones.
        """
        model_dir = Path(model_dir)
        model_file = model_dir / "spm.model"
        languages = sorted(_texts_by_language(corpus))
        if not model_file.is_file():
            cls._train(corpus, model_dir, vocab_size, sample_per_language, model_type, seed)
        vocab = cls(model_file)
        absent = [lang for lang in languages if vocab.sp.piece_to_id(lang_token(lang)) == 1]
        if absent:
            raise ValueError(
                f"{model_file} lacks language tokens for {absent}; remove it to retrain"
            )
        return vocab

    @staticmethod
    def _train(
        corpus: Mapping[str, Sequence[tuple[str, str]]],
        model_dir: Path,
        vocab_size: int,
        sample_per_language: int,
        model_type: str,
        seed: int,
    ) -> None:
        import sentencepiece as spm

        texts = _texts_by_language(corpus)
        rng = random.Random(seed)
        model_dir.mkdir(parents=True, exist_ok=True)
        sample_file = model_dir / "spm_train_sample.txt"
        with sample_file.open("w", encoding="utf-8") as f:
            for lang in sorted(texts):
                lines = texts[lang]
                chosen = rng.sample(lines, min(len(lines), sample_per_language))
                f.writelines(line.replace("\n", " ") + "\n" for line in chosen)
        spm.SentencePieceTrainer.train(
            input=str(sample_file),
            model_prefix=str(model_dir / "spm"),
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            user_defined_symbols=[lang_token(lang) for lang in sorted(texts)],
            hard_vocab_limit=False,
            num_threads=1,
            minloglevel=2,
        )
        sample_file.unlink()

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def lang_id(self, lang: str) -> int:
        return int(self.sp.piece_to_id(lang_token(lang)))

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text, out_type=int))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, stopping at ``</s>`` and skipping padding and ``<s>``.

        Ids past the vocabulary (a model's output layer may be larger than the trained
        SentencePiece model) read as ``<unk>``.
        """
        kept = []
        size = self.vocab_size
        for i in ids:
            if i == self.eos_id:
                break
            if i not in (self.pad_id, self.bos_id):
                kept.append(int(i) if 0 <= i < size else self.unk_id)
        return str(self.sp.decode(kept))


def fits(src_ids: Sequence[int], tgt_ids: Sequence[int], max_len: int) -> bool:
    """Whether an encoded example fits ``max_len`` positions: the source with its markers, the
    target with one (``<s>`` in, ``</s>`` out).

    Example::

        fits([5, 17, 3], [9, 9], max_len=3)    # True
    """
    return len(src_ids) <= max_len and len(tgt_ids) + 1 <= max_len


def encode_corpus(
    corpus: Mapping[str, Sequence[tuple[str, str]]],
    vocab: SharedVocabulary,
    max_len: int | None = 256,
) -> EncodedCorpus:
    """``{pair: [(src_ids, tgt_ids)]}``: src = <2tgt> x </s>; tgt without <s>/</s> markers.

    Examples that do not :func:`fits` ``max_len`` tokens are dropped (None: every one is kept).
    """
    encoded: EncodedCorpus = {}
    for pair, examples in sorted(corpus.items()):
        lang = vocab.lang_id(split_pair(pair)[1])
        rows = []
        for src, tgt in examples:
            src_ids = [lang, *vocab.encode(src), vocab.eos_id]
            tgt_ids = vocab.encode(tgt)
            if max_len is None or fits(src_ids, tgt_ids, max_len):
                rows.append((src_ids, tgt_ids))
        encoded[pair] = rows
    return encoded
