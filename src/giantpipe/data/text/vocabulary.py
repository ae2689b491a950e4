"""The tokenizer of ``data=text``: ``data.tokenizer`` (a Hugging Face tokenizer directory or a
SentencePiece ``.model``), or SentencePiece trained on the training documents and cached under
a key of their content, so a second run, or a resumed one, reuses it.

Example::

    from giantpipe.data.text.vocabulary import Vocabulary

    vocab = Vocabulary.load(Path("corpus/.giantpipe_cache/spm-ab12...-500.model"))
    vocab.encode("the dog sees a cat")     # [17, 9, ...]
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from giantpipe.config import ConfigError

log = logging.getLogger(__name__)


class Vocabulary:
    """Text <-> ids, with one end-of-text id that closes every document.

    A SentencePiece ``.model`` file or a Hugging Face tokenizer directory (read locally).

    Example::

        vocab = Vocabulary.load(Path("corpus/.giantpipe_cache/spm-ab12...-500.model"))
        vocab.encode("the dog sees a cat")     # [17, 9, ...]
        vocab.size, vocab.eos_id               # (500, 2)
        vocab.decode([17, 9, 4000])            # an id past the tokenizer reads as unknown
    """

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 size: int, eos_id: int, source: str) -> None:  # fmt: skip
        self.encode, self.decode, self.size, self.eos_id = encode, decode, size, eos_id
        self.source = source

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        """A SentencePiece model file or a Hugging Face tokenizer directory."""
        if path.is_file():
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor(model_file=str(path))
            eos = sp.eos_id() if sp.eos_id() >= 0 else sp.unk_id()
            size, unk = sp.get_piece_size(), sp.unk_id()

            def decode_pieces(ids: list[int]) -> str:
                # a model's output may be wider than the tokenizer (data.vocab_size >= its size)
                return str(sp.decode([i if 0 <= i < size else unk for i in ids]))

            return cls(sp.encode, decode_pieces, size, eos, str(path))
        try:
            import transformers
        except ImportError as err:
            raise ConfigError(
                "data.tokenizer", "a tokenizer directory needs transformers: pip install -e .[hf]"
            ) from err
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as err:  # noqa: BLE001 - a folder that holds no tokenizer
            reason = " ".join(str(err).split())[:200]
            raise ConfigError("data.tokenizer", f"{path}: not a tokenizer ({reason})") from err
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if eos is None:
            raise ConfigError("data.tokenizer", f"{path}: the tokenizer has no end-of-text token")

        def encode(text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"])

        def decode(ids: list[int]) -> str:
            size, unk = len(tok), tok.unk_token_id  # ids past the tokenizer: unknown, or left out
            kept = [i if 0 <= i < size else unk for i in ids]
            return str(tok.decode([i for i in kept if i is not None]))

        return cls(encode, decode, len(tok), int(eos), str(path))


def train_sentencepiece(texts: Sequence[str], model_file: Path, vocab_size: int, seed: int) -> None:
    """Train a unigram SentencePiece model on ``texts`` into ``model_file`` (written whole or
    not at all). Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (end of text); no padding (packed)."""
    import random

    import sentencepiece as spm

    model_file.parent.mkdir(parents=True, exist_ok=True)
    prefix = model_file.with_name(f".tmp-{model_file.stem}")
    sample = prefix.with_suffix(".txt")
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    random.Random(seed).shuffle(lines)  # the trainer reads at most input_sentence_size lines
    sample.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        spm.SentencePieceTrainer.train(
            input=str(sample),
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            hard_vocab_limit=False,  # a small corpus gets fewer pieces, not an error
            model_type="unigram",
            character_coverage=1.0,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            input_sentence_size=1_000_000,
            shuffle_input_sentence=False,  # shuffled above, by the seed
            minloglevel=2,
        )
    except RuntimeError as err:  # e.g. fewer distinct characters than the reserved pieces
        reason = " ".join(str(err).split())[:200]
        raise ConfigError("data.vocab_size", f"SentencePiece training failed: {reason}") from err
    finally:
        sample.unlink(missing_ok=True)
        prefix.with_suffix(".vocab").unlink(missing_ok=True)
    prefix.with_suffix(".model").replace(model_file)


def cache_dir_for(paths: Sequence[Path], cache_dir: str | None, run_dir: Path | None) -> Path:
    """``data.cache_dir``, else ``.giantpipe_cache`` beside the first file (the run directory
    when that folder cannot be written)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    beside = paths[0].parent / ".giantpipe_cache"
    try:
        beside.mkdir(exist_ok=True)
        return beside
    except OSError as err:
        if run_dir is None:
            raise ConfigError("data.cache_dir", f"cannot write {beside} ({err.strerror})") from err
        return run_dir / "tokenizer"


def vocabulary(
    tokenizer: str | None, train_texts: Sequence[str], cache: Path, key: str, vocab_size: int,
    seed: int, run_dir: Path | None = None,
) -> Vocabulary:  # fmt: skip
    """``data.tokenizer`` when given, else the SentencePiece model cached under ``key``, or the
    copy a run keeps of it (trained now when neither is there); a tokenizer with more ids than
    ``data.vocab_size`` is a ConfigError."""
    if tokenizer:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise ConfigError(
                "data.tokenizer", f"{path} not found (a tokenizer directory or .model)"
            )
        vocab = Vocabulary.load(path)
    else:
        name = f"spm-{key[:16]}-{vocab_size}.model"
        # The run keeps a copy under the same name, so a resume finds the very tokenizer it
        # trained with even when the cache beside the data is gone (a retrained one could differ).
        kept = [d / name for d in (cache, run_dir) if d is not None and (d / name).is_file()]
        model_file = kept[0] if kept else cache / name
        if not kept:
            train_sentencepiece(train_texts, model_file, vocab_size, seed)
        if run_dir is not None and not (run_dir / name).is_file():
            shutil.copyfile(model_file, run_dir / name)
        vocab = Vocabulary.load(model_file)
        log.info("tokenizer: %s %s (%d pieces)", "reusing" if kept else "trained",
                 model_file, vocab.size)  # fmt: skip
    if vocab.size > vocab_size:
        raise ConfigError(
            "data.vocab_size",
            f"is {vocab_size}, but {vocab.source} has {vocab.size} ids; the model's output must "
            f"hold them all: set data.vocab_size={vocab.size} or more",
        )
    return vocab
