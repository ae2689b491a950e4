"""The ``data=text`` option: your own text as language-model batches.

    python train.py recipe=llama_quickstart data=text 'data.files=[corpus/*.txt]'

What :func:`text` does, in order:

1. files: ``data.files``, globs (``**`` goes into folders) of ``.txt``, ``.jsonl`` (one JSON object
   a line, its ``data.text_field``), ``.parquet`` (the ``data.text_field`` column) files, or a
   folder a ``datasets`` dataset was saved to with ``save_to_disk`` (its ``train`` split when it
   is a DatasetDict); a pattern that matches nothing, or a line that cannot be read, is one
   ConfigError naming ``data.files``, the file and the line (as the translation reader does);
2. documents: a ``.txt`` file is one document per paragraph (text between blank lines; or the
   whole file, or each line: ``data.txt_documents``), a JSON line / parquet or dataset row is one;
3. split: ``data.valid_fraction`` of the documents (at least one) are held out, drawn by
   ``data.seed``, so no held-out sentence is ever trained on;
4. tokenizer: ``data.tokenizer``, a Hugging Face tokenizer directory (read locally) or a
   SentencePiece ``.model`` file, or else SentencePiece trained on the training documents and
   cached beside the data (``.giantpipe_cache/`` in the first file's folder, or
   ``data.cache_dir``), keyed by the files' content hash, the split and ``data.vocab_size``: a
   second run, or a resumed one, reuses it;
5. packing: each split's documents, each ended by the end-of-text token, are concatenated and cut
   into sequences of ``data.seq_len`` + 1 tokens (input and next-token target); training batches
   are a shuffle of these, a pure function of (seed, position), so resume sees the same batches.

The evaluation loss is the held-out cross-entropy per token, so held-out perplexity is
``exp(eval/loss)``; :func:`unigram_perplexity` is the baseline a model must beat.

Example::

    bundle = text(files=["corpus/*.txt"], seq_len=64, batch_size=8, vocab_size=500)
    tokens, next_tokens = next(bundle.train_batches(0, 0))        # [8, 64] each
    bundle.vocab.decode(tokens[0].tolist())                       # the text back
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from giantpipe.config import ConfigError, check, check_choice, check_min
from giantpipe.data.bundle import DataBundle
from giantpipe.data.corpus import CorpusError, _jsonl_rows, _parquet_rows
from giantpipe.data.tensors import epoch_order, sequential_batches, shuffled_batches

log = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl", ".parquet")
DOCUMENTS = ("paragraph", "file", "line")
HOW_TO_PROVIDE = (
    "give data.files=[...] globs of .txt, .jsonl (a 'text' field) or .parquet files, or a folder "
    "saved by datasets' save_to_disk"
)


@dataclass
class Document:
    """One document's text and where it came from (``corpus/a.txt, line 3``)."""

    where: str
    text: str


# --------------------------------------------------------------------------- files


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``)."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json")
    )


def expand_files(patterns: Sequence[str]) -> list[Path]:
    """The files (and saved datasets) the patterns name, sorted within each pattern; a
    ConfigError naming ``data.files`` for an empty list, a pattern matching nothing, or a
    file of another format.

    Example::

        expand_files(["corpus/*.txt", "more/books.jsonl"])
    """
    if not patterns:
        raise ConfigError("data.files", f"no files given; {HOW_TO_PROVIDE}")
    found: list[Path] = []
    for pattern in patterns:
        matches = sorted(
            Path(p) for p in glob.glob(str(Path(pattern).expanduser()), recursive=True)
        )
        if not matches:
            raise ConfigError("data.files", f"{pattern!r} matches no file; {HOW_TO_PROVIDE}")
        for path in matches:
            if is_saved_dataset(path):
                found.append(path)
            elif path.is_dir():
                inside = sorted(p for p in path.rglob("*") if _readable(p, path))
                if not inside:
                    raise ConfigError("data.files", f"{path} holds no {'/'.join(SUFFIXES)} file")
                found += inside
            elif path.suffix not in SUFFIXES:
                raise ConfigError(
                    "data.files", f"{path}: unknown format {path.suffix!r}; {HOW_TO_PROVIDE}"
                )
            else:
                found.append(path)
    return list(dict.fromkeys(found))  # a file two patterns match is read once


def _readable(path: Path, folder: Path) -> bool:
    """A file of a known format in ``folder``, outside hidden folders (the tokenizer cache)."""
    hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
    return path.suffix in SUFFIXES and path.is_file() and not hidden


def _txt_documents(path: Path, mode: str) -> Iterator[Document]:
    """Paragraphs (or the file, or its lines) of a UTF-8 text file; a byte that is not UTF-8
    is a CorpusError naming the file and the line."""
    lines: list[str] = []
    start = 1
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n").removeprefix("\ufeff")
            except UnicodeDecodeError as err:
                problem = f"not UTF-8 text ({err.reason} at byte {err.start})"
                raise CorpusError(f"{path}, line {number}: {problem}") from None
            if line.strip():
                start = start if lines else number
                lines.append(line)
            if lines and (mode == "line" or (mode == "paragraph" and not line.strip())):
                yield Document(f"{path}, line {start}", "\n".join(lines))
                lines = []
    if lines:
        yield Document(f"{path}, line {start}", "\n".join(lines))


def _row_documents(path: Path, text_field: str) -> Iterator[Document]:
    """JSON lines or parquet rows: the ``text_field`` of each, which must be text."""
    reader = _parquet_rows if path.suffix == ".parquet" else _jsonl_rows
    rows = reader(path, [text_field])
    for where, row in rows:
        value = row[text_field]
        if not isinstance(value, str):
            raise CorpusError(f"{path}, {where}: field {text_field!r} is {value!r}; expected text")
        if value.strip():
            yield Document(f"{path}, {where}", value)


def _dataset_documents(path: Path, text_field: str) -> Iterator[Document]:
    """The rows of a dataset saved with ``save_to_disk`` (a DatasetDict's ``train`` split)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - datasets raises several types for a bad folder
        raise CorpusError(f"{path}: not a readable saved dataset ({err})") from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise CorpusError(f"{path}: a DatasetDict without a 'train' split ({list(loaded)})")
        loaded = loaded["train"]
    if text_field not in loaded.column_names:
        raise CorpusError(
            f"{path}: no column {text_field!r} (found {loaded.column_names}); set data.text_field"
        )
    for index, value in enumerate(loaded[text_field]):
        if not isinstance(value, str):
            raise CorpusError(f"{path}, row {index + 1}: {text_field!r} is {value!r}; not text")
        if value.strip():
            yield Document(f"{path}, row {index + 1}", value)


def read_documents(paths: Sequence[Path], text_field: str, txt_documents: str) -> list[Document]:
    """Every document of ``paths`` in order; a problem is a ConfigError naming ``data.files``,
    the file and the line (or row).

    Example::

        docs = read_documents([Path("corpus/a.txt")], "text", "paragraph")
        docs[0].where                  # 'corpus/a.txt, line 1'
    """
    documents: list[Document] = []
    for path in paths:
        try:
            if is_saved_dataset(path):
                part = list(_dataset_documents(path, text_field))
            elif path.suffix == ".txt":
                part = list(_txt_documents(path, txt_documents))
            else:
                part = list(_row_documents(path, text_field))
        except CorpusError as err:
            raise ConfigError("data.files", str(err)) from err
        if not part:
            raise ConfigError("data.files", f"{path}: no text; expected at least one document")
        documents += part
    return documents


def content_hash(paths: Sequence[Path]) -> str:
    """sha256 over the files' bytes (a saved dataset's files too), in order: the cache key."""
    digest = hashlib.sha256()
    for path in paths:
        for part in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if part.is_file():
                digest.update(part.name.encode() + b"\0")
                with part.open("rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- split


def held_out(count: int, fraction: float, seed: int) -> set[int]:
    """Indices of the held-out documents: ``fraction`` of ``count`` (at least one, at most all
    but one), drawn by ``seed``; the same every time.

    Example::

        held_out(10, 0.2, seed=0)    # two indices, always the same two
    """
    if count < 2:
        raise ConfigError(
            "data.files",
            f"{count} document(s); a held-out split needs at least 2 (with data.txt_documents="
            "paragraph, separate documents with a blank line)",
        )
    size = min(count - 1, max(1, round(fraction * count)))
    return set(epoch_order(count, seed, epoch=0)[:size].tolist())


# --------------------------------------------------------------------------- tokenizer


class Vocabulary:
    """Text <-> ids, with one end-of-text id that closes every document.

    A SentencePiece ``.model`` file or a Hugging Face tokenizer directory (read locally).

    Example::

        vocab = Vocabulary.load(Path("corpus/.giantpipe_cache/spm-ab12...-500.model"))
        vocab.encode("the dog sees a cat")     # [17, 9, ...]
        vocab.size, vocab.eos_id               # (500, 2)
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
            return cls(sp.encode, sp.decode, sp.get_piece_size(), eos, str(path))
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
            return str(tok.decode(ids))

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


# --------------------------------------------------------------------------- packing


def pack(texts: Sequence[str], vocab: Vocabulary, seq_len: int) -> Tensor:
    """[N, seq_len + 1] int64: the documents' ids, each followed by end-of-text, concatenated and
    cut into rows that overlap by one token (row i's last token starts row i + 1), so every
    token but the first is a target exactly once. The tail shorter than a row is left out.

    Example::

        rows = pack(["a b c", "d e"], vocab, seq_len=4)   # inputs rows[:, :-1], targets rows[:, 1:]
    """
    # One tensor per document (a Python list of every id would take ~10x the memory).
    parts = [torch.tensor([*vocab.encode(doc), vocab.eos_id], dtype=torch.long) for doc in texts]
    stream = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    rows = (len(stream) - 1) // seq_len
    if rows < 1:
        return torch.empty(0, seq_len + 1, dtype=torch.long)
    starts = torch.arange(rows) * seq_len
    return stream[starts.unsqueeze(1) + torch.arange(seq_len + 1)]


def unigram_perplexity(train: Tensor, held: Tensor, vocab_size: int) -> float:
    """The held-out perplexity of the training set's token frequencies (add-one smoothed): what
    a model that ignores context scores, the baseline a language model must beat.

    Example::

        unigram_perplexity(train_rows[:, 1:], valid_rows[:, 1:], vocab.size)   # e.g. 41.7
    """
    counts = torch.bincount(train.flatten(), minlength=vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return math.exp(-log_p[held.flatten()].mean().item())


# --------------------------------------------------------------------------- the bundle


@dataclass
class TextCorpus:
    """The documents split, tokenized and packed: what :func:`text` serves as batches."""

    vocab: Vocabulary
    train_rows: Tensor
    """[N, seq_len + 1] packed training tokens."""
    valid_rows: Tensor
    """[V, seq_len + 1] packed held-out tokens."""
    documents: int
    held_out: int

    def unigram_perplexity(self) -> float:
        """The held-out perplexity of the training tokens' frequencies (the baseline)."""
        return unigram_perplexity(self.train_rows[:, 1:], self.valid_rows[:, 1:], self.vocab.size)


def read_text_corpus(
    files: Sequence[str],
    seq_len: int = 128,
    vocab_size: int = 2000,
    tokenizer: str | None = None,
    text_field: str = "text",
    txt_documents: str = "paragraph",
    valid_fraction: float = 0.1,
    cache_dir: str | None = None,
    seed: int = 1234,
    run_dir: Path | None = None,
) -> TextCorpus:
    """Steps 1 to 5 of the module docstring: files -> documents -> split -> tokens -> rows.

    Example::

        corpus = read_text_corpus(["corpus/*.txt"], seq_len=64, vocab_size=500)
        corpus.train_rows.shape, corpus.unigram_perplexity()     # (torch.Size([812, 65]), 41.7)
    """
    paths = expand_files(files)
    documents = read_documents(paths, text_field, txt_documents)
    valid = held_out(len(documents), valid_fraction, seed)
    train_texts = [d.text for i, d in enumerate(documents) if i not in valid]
    valid_texts = [d.text for i, d in enumerate(documents) if i in valid]
    key = hashlib.sha256(
        f"{content_hash(paths)} {text_field} {txt_documents} {valid_fraction} {seed}".encode()
    ).hexdigest()
    cache = cache_dir_for(paths, cache_dir, run_dir)
    vocab = vocabulary(tokenizer, train_texts, cache, key, vocab_size, seed, run_dir)
    train_rows, valid_rows = pack(train_texts, vocab, seq_len), pack(valid_texts, vocab, seq_len)
    return TextCorpus(vocab, train_rows, valid_rows, len(documents), len(valid))


def text(
    files: Sequence[str],
    seq_len: int = 128,
    batch_size: int = 16,
    vocab_size: int = 2000,
    tokenizer: str | None = None,
    text_field: str = "text",
    txt_documents: str = "paragraph",
    valid_fraction: float = 0.1,
    eval_batches: int | None = None,
    cache_dir: str | None = None,
    seed: int = 1234,
    run_dir: Path | None = None,
) -> DataBundle:
    """Language-model batches from your text files (fields: :class:`TextDataConfig`); with a
    ``run_dir``, ``text_data.json`` there records the split and the unigram baseline.

    Example::

        bundle = text(["corpus/*.txt"], seq_len=64, batch_size=8, vocab_size=500)
        bundle.tokens_per_batch(next(bundle.train_batches(0, 0)))      # 512
    """
    corpus = read_text_corpus(
        files, seq_len, vocab_size, tokenizer, text_field, txt_documents, valid_fraction,
        cache_dir, seed, run_dir,
    )  # fmt: skip
    train_rows, valid_rows = corpus.train_rows, corpus.valid_rows
    _check_sizes(train_rows, valid_rows, batch_size, seq_len)
    facts = {
        "documents": corpus.documents,
        "held_out_documents": corpus.held_out,
        "train_sequences": len(train_rows),
        "held_out_sequences": len(valid_rows),
        "tokenizer": corpus.vocab.source,
        "vocab": corpus.vocab.size,
        "unigram_perplexity": corpus.unigram_perplexity(),
    }
    log.info("text data: %s", ", ".join(f"{k} {v}" for k, v in facts.items()))
    if run_dir is not None:
        (run_dir / "text_data.json").write_text(json.dumps(facts, indent=2) + "\n")
    inputs, targets = train_rows[:, :-1].contiguous(), train_rows[:, 1:].contiguous()
    held = sequential_batches(valid_rows[:, :-1], valid_rows[:, 1:], batch_size)[:eval_batches]
    return DataBundle(
        train_batches=lambda order_seed, position: shuffled_batches(
            inputs, targets, batch_size, order_seed, position
        ),
        eval_batches=lambda: held,
        batches_per_epoch=len(train_rows) // batch_size,
        loss="cross_entropy",
        metric="accuracy",
        tokens_per_batch=lambda batch: batch[1].numel(),  # type: ignore[union-attr]
        eval_set=f"the held-out documents of {', '.join(files)}",
    )


def _check_sizes(train_rows: Tensor, valid_rows: Tensor, batch_size: int, seq_len: int) -> None:
    if len(valid_rows) == 0:
        raise ConfigError(
            "data.valid_fraction",
            f"the held-out documents hold fewer than data.seq_len + 1 = {seq_len + 1} tokens; "
            "raise data.valid_fraction or lower data.seq_len",
        )
    if len(train_rows) < batch_size:
        raise ConfigError(
            "data.batch_size",
            f"is {batch_size}, but the training documents make only {len(train_rows)} "
            f"sequences of data.seq_len={seq_len} tokens; lower one or add text",
        )


@dataclass
class TextDataConfig:
    """``data=text``: the arguments of :func:`text`, checked up front."""

    _target_: str = "giantpipe.data.text.text"
    """Builder called with the other fields."""
    files: list[str] = field(default_factory=list)
    """Globs of .txt / .jsonl / .parquet files, or folders saved by datasets' save_to_disk."""
    seq_len: int = 128
    """Tokens per sequence."""
    batch_size: int = 16
    """Sequences per mini-batch N."""
    vocab_size: int = 2000
    """Ids the model outputs: the SentencePiece size to train, or >= the given tokenizer's."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer directory or a SentencePiece .model; null: train SentencePiece."""
    text_field: str = "text"
    """The field (.jsonl) or column (.parquet, saved datasets) holding the text."""
    txt_documents: str = "paragraph"
    """What one document of a .txt file is: ``paragraph`` (blank-line separated), ``file``,
    ``line``."""
    valid_fraction: float = 0.1
    """Share of the documents held out for evaluation (at least one document)."""
    eval_batches: int | None = None
    """Held-out batches per evaluation; null: all of them."""
    cache_dir: str | None = None
    """Where the trained tokenizer is kept; null: .giantpipe_cache beside the first file."""
    seed: int = 1234
    """Seed of the held-out split and of the tokenizer's training (batch order: trainer.seed)."""

    def __post_init__(self) -> None:
        check_min(self.seq_len, 2, "data.seq_len")
        check_min(self.batch_size, 1, "data.batch_size")
        check_min(self.vocab_size, 8, "data.vocab_size")
        check_choice(self.txt_documents, DOCUMENTS, "data.txt_documents")
        check(
            0.0 < self.valid_fraction < 1.0,
            "data.valid_fraction",
            f"must be between 0 and 1, got {self.valid_fraction}",
        )
        if self.eval_batches is not None:
            check_min(self.eval_batches, 1, "data.eval_batches")
        check(bool(re.fullmatch(r"\S+", self.text_field)), "data.text_field", "must name a field")
