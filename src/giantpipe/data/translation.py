"""Multilingual translation data: local corpora, a shared SentencePiece vocabulary, temperature
sampling across language pairs and resumable token-based batches.

The flow, as in the paper's multilingual setup (one model, all pairs at once)::

    corpus = load_parallel_corpus(["train.tsv"])              # giantpipe.data.corpus
    vocab = SharedVocabulary.train_or_load(corpus, "run/spm", vocab_size=8000)
    data = encode_corpus(corpus, vocab)                       # {pair: [(src_ids, tgt_ids), ...]}
    batches = MultilingualBatches(data, max_tokens=4096, temperature=5.0, seed=0)
    batch = next(batches)                                     # TranslationBatch
    logits = model(batch.inputs())                            # (src_tokens, tgt_in_tokens)
    state = batches.state_dict()                              # save; load_state_dict(state) resumes

A pair is named "src-tgt" (e.g. "en-xa"). The source starts with the target-language token
``<2tgt>`` and ends with ``</s>``; the decoder reads ``<s> y`` and predicts ``y </s>``. Padding
id is 0. Batches hold one language pair each, drawn with p_i proportional to (n_i / N)^(1/T).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from giantpipe.data.corpus import split_pair

__all__ = [
    "lang_token",
    "SharedVocabulary",
    "encode_corpus",
    "fits",
    "temperature_probabilities",
    "token_batches",
    "TranslationBatch",
    "collate",
    "MultilingualBatches",
    "eval_batches",
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


def temperature_probabilities(
    sizes: Mapping[str, int], temperature: float = 5.0
) -> dict[str, float]:
    """p_i = q_i^(1/T) / sum_j q_j^(1/T) with q_i = n_i / N; T=1 is proportional, T->inf uniform.

    Example::

        temperature_probabilities({"en-fr": 900, "en-xh": 100}, temperature=5.0)
        # {'en-fr': 0.6083..., 'en-xh': 0.3916...}
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    total = sum(sizes.values())
    if total <= 0 or any(n < 0 for n in sizes.values()):
        raise ValueError(f"sizes must be non-negative with a positive sum, got {dict(sizes)}")
    weights = {pair: (n / total) ** (1.0 / temperature) for pair, n in sizes.items()}
    norm = sum(weights.values())
    return {pair: w / norm for pair, w in weights.items()}


def example_size(src_ids: Sequence[int], tgt_ids: Sequence[int]) -> int:
    """Padded positions an example needs: max(source length, target length + 1)."""
    return max(len(src_ids), len(tgt_ids) + 1)


def token_batches(
    sizes: Sequence[int], max_tokens: int, rng: np.random.Generator, min_sentences: int = 1
) -> list[list[int]]:
    """Group example indices into batches of ``len(batch) * max(size) <= max_tokens``.

    Length bucketing: sort by size (ties broken randomly), cut greedily, shuffle batch order.
    Examples larger than ``max_tokens`` are left out, and so are batches of fewer than
    ``min_sentences`` examples (a pipeline needs one sentence per micro-batch at least); with
    every size <= max_tokens // min_sentences only the last, longest batch can be that small.
    """
    order = rng.permutation(len(sizes))
    order = order[np.argsort(np.asarray(sizes)[order], kind="stable")] if len(sizes) else order
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order.tolist():
        size = sizes[index]
        if size > max_tokens:
            continue
        if current and (len(current) + 1) * max(longest, size) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, size)
    if current:
        batches.append(current)
    batches = [b for b in batches if len(b) >= min_sentences]
    return [batches[i] for i in rng.permutation(len(batches)).tolist()]


@dataclass
class TranslationBatch:
    """One language pair's padded batch. Masks are bool, True at padding."""

    src_tokens: Tensor  # int64 [B, S]: <2tgt> x </s>
    tgt_in: Tensor  # int64 [B, T]: <s> y
    tgt_out: Tensor  # int64 [B, T]: y </s>
    pair: str
    pad_id: int = 0

    def inputs(self) -> tuple[Tensor, Tensor]:
        """The model input tuple (src_tokens, tgt_in_tokens)."""
        return self.src_tokens, self.tgt_in

    @property
    def src_padding_mask(self) -> Tensor:
        return self.src_tokens.eq(self.pad_id)

    @property
    def tgt_padding_mask(self) -> Tensor:
        return self.tgt_out.eq(self.pad_id)

    @property
    def num_tokens(self) -> int:
        """Padded positions, counted as for ``max_tokens``: B * max(S, T)."""
        return self.src_tokens.shape[0] * max(self.src_tokens.shape[1], self.tgt_in.shape[1])


def collate(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pair: str,
    pad_id: int = 0,
    bos_id: int = 2,
    eos_id: int = 3,
) -> TranslationBatch:
    """Pad encoded examples into a ``TranslationBatch`` (right padding)."""
    src_len = max(len(s) for s, _ in examples)
    tgt_len = max(len(t) for _, t in examples) + 1
    src = torch.full((len(examples), src_len), pad_id, dtype=torch.long)
    tgt_in = torch.full((len(examples), tgt_len), pad_id, dtype=torch.long)
    tgt_out = torch.full((len(examples), tgt_len), pad_id, dtype=torch.long)
    for row, (s, t) in enumerate(examples):
        src[row, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        tgt_in[row, : len(t) + 1] = torch.tensor([bos_id, *t], dtype=torch.long)
        tgt_out[row, : len(t) + 1] = torch.tensor([*t, eos_id], dtype=torch.long)
    return TranslationBatch(src, tgt_in, tgt_out, pair, pad_id)


class MultilingualBatches(Iterator[TranslationBatch]):
    """Endless, deterministic stream of token-bucketed batches across language pairs.

    Step s draws a pair with ``temperature_probabilities`` from a generator seeded by
    (seed, s), then takes that pair's next batch; each pair walks through epochs of batches
    shuffled by (seed, pair, epoch). The whole position is three counters, so
    ``state_dict()`` / ``load_state_dict()`` resume exactly.

    Example::

        batches = MultilingualBatches(encoded, max_tokens=2048, temperature=5.0, seed=1)
        first = next(batches)
        state = batches.state_dict()
        again = MultilingualBatches(encoded, max_tokens=2048, temperature=5.0, seed=1)
        again.load_state_dict(state)       # next(again) equals next(batches)
    """

    def __init__(
        self,
        data: Mapping[str, Sequence[tuple[Sequence[int], Sequence[int]]]],
        max_tokens: int,
        *,
        temperature: float = 5.0,
        seed: int = 0,
        pad_id: int = 0,
        bos_id: int = 2,
        eos_id: int = 3,
        min_sentences: int = 1,
    ) -> None:
        sizes = {p: [example_size(s, t) for s, t in rows] for p, rows in data.items()}
        # An example fits when a batch of min_sentences such examples fits in max_tokens.
        longest = max_tokens // max(min_sentences, 1)
        fits = {p: sum(n <= longest for n in sizes[p]) for p in data}
        self.pairs = sorted(p for p in data if fits[p] >= max(min_sentences, 1))
        if not self.pairs:
            raise ValueError(
                f"no language pair has {min_sentences} example(s) that fit max_tokens={max_tokens}"
            )
        self.data = {p: data[p] for p in self.pairs}
        self.sizes = {p: sizes[p] for p in self.pairs}
        fitting = {p: fits[p] for p in self.pairs}
        self.max_tokens, self.seed, self.special = max_tokens, seed, (pad_id, bos_id, eos_id)
        self.min_sentences = min_sentences
        probs = temperature_probabilities(fitting, temperature)
        self.probabilities = np.array([probs[p] for p in self.pairs])
        self.step = 0
        self.epoch = dict.fromkeys(self.pairs, 0)
        self.cursor = dict.fromkeys(self.pairs, 0)
        self._cache: dict[str, tuple[int, list[list[int]]]] = {}

    def _batches(self, pair: str) -> list[list[int]]:
        epoch = self.epoch[pair]
        if self._cache.get(pair, (-1, []))[0] != epoch:
            rng = np.random.default_rng([self.seed, self.pairs.index(pair), epoch])
            batches = token_batches(self.sizes[pair], self.max_tokens, rng, self.min_sentences)
            self._cache[pair] = (epoch, batches)
        return self._cache[pair][1]

    def next_pair(self) -> str:
        rng = np.random.default_rng([self.seed, 1_000_003, self.step])
        return self.pairs[int(rng.choice(len(self.pairs), p=self.probabilities))]

    def _advance(self) -> tuple[str, list[int]]:
        """The next (pair, example indices), moving the position on by one batch."""
        pair = self.next_pair()
        if self.cursor[pair] >= len(self._batches(pair)):  # start the pair's next epoch
            self.epoch[pair], self.cursor[pair] = self.epoch[pair] + 1, 0
        indices = self._batches(pair)[self.cursor[pair]]
        self.cursor[pair] += 1
        self.step += 1
        return pair, indices

    def __next__(self) -> TranslationBatch:
        pair, indices = self._advance()
        pad_id, bos_id, eos_id = self.special
        return collate([self.data[pair][i] for i in indices], pair, pad_id, bos_id, eos_id)

    def skip(self, count: int) -> None:
        """Move on by ``count`` batches without building them (a resume at position ``count``).

        Example::

            stream.skip(1000)      # next(stream) is the batch an unbroken run takes 1001st
        """
        for _ in range(count):
            self._advance()

    def batches_per_epoch(self) -> int:
        """Batches in one pass over every pair's (first) epoch: the data set's epoch length."""
        return sum(
            len(
                token_batches(
                    self.sizes[p], self.max_tokens, np.random.default_rng(0), self.min_sentences
                )
            )
            for p in self.pairs
        )

    def state_dict(self) -> dict:
        """Position of the stream (plain ints, JSON-serialisable)."""
        return {
            "seed": self.seed,
            "step": self.step,
            "epoch": dict(self.epoch),
            "cursor": dict(self.cursor),
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state["seed"] != self.seed or sorted(state["epoch"]) != self.pairs:
            raise ValueError("batch-iterator state was saved for another seed or set of pairs")
        self.step = int(state["step"])
        self.epoch = {p: int(e) for p, e in state["epoch"].items()}
        self.cursor = {p: int(c) for p, c in state["cursor"].items()}


def eval_batches(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pair: str,
    max_tokens: int,
    pad_id: int = 0,
    bos_id: int = 2,
    eos_id: int = 3,
) -> Iterator[tuple[list[int], TranslationBatch]]:
    """Batches of one pair in a fixed length-sorted order, with the example indices they hold.

    Unlike training, an example longer than ``max_tokens`` is kept, alone in its batch.
    """
    sizes = [example_size(s, t) for s, t in examples]
    order = sorted(range(len(examples)), key=lambda i: (sizes[i], i))
    current: list[int] = []
    for index in order:
        if current and (len(current) + 1) * sizes[index] > max_tokens:
            yield current, collate([examples[i] for i in current], pair, pad_id, bos_id, eos_id)
            current = []
        current.append(index)
    if current:
        yield current, collate([examples[i] for i in current], pair, pad_id, bos_id, eos_id)
