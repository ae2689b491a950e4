"""The ``data=translation`` option: multilingual parallel text as a DataBundle for the runner.

    python train.py recipe=transformer_quickstart     # generated corpus, written into the run dir
    python train.py recipe=transformer_translation \\
        data.train_files=[corpus/train.tsv] data.valid_files=[corpus/valid.tsv]

What :func:`translation` does, in order:

1. files: ``data.train_files`` / ``data.valid_files``, or (both null) the generated corpus of
   ``giantpipe.data.synthetic_corpus`` written to ``RUN_DIR/corpus``; a missing file is one
   ConfigError line naming the key and the path and saying what to provide;
2. vocabulary: ``RUN_DIR/spm.model`` (or ``data.vocab_dir``), one SentencePiece model for every
   language with ``<2xx>`` tokens, trained on the first run and reused when it resumes;
3. training batches: a language pair drawn by temperature, then that pair's next token-bucketed
   batch (lengths change from step to step), a pure function of (seed, position);
4. loss: cross-entropy summed over non-pad target tokens and divided by their count in the whole
   mini-batch (``loss_normalizer``); tokens/s counts the same target tokens;
5. evaluation: the loss on the held-out files, and ``evaluate_model`` decodes held-out sentences
   for sacreBLEU per pair and averaged, next to the copy-the-source baseline and decoding tokens/s.

Example::

    bundle = translation(max_tokens=1024, min_sentences=4, run_dir="outputs/run")
    (src_tokens, tgt_in), tgt_out = next(bundle.train_batches(0, 0))
    bundle.evaluate_model(model)        # {"bleu": 12.3, "bleu/en-xa": 15.1, ...}
"""

from __future__ import annotations

import itertools
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from giantpipe.config import ConfigError, check, check_min
from giantpipe.data.bleu import HeldOutBleu
from giantpipe.data.bundle import Batch, DataBundle
from giantpipe.data.synthetic_corpus import write_synthetic_corpus
from giantpipe.data.translation import (
    Corpus,
    EncodedCorpus,
    MultilingualBatches,
    SharedVocabulary,
    collate,
    encode_corpus,
    example_size,
    load_parallel_corpus,
)

log = logging.getLogger(__name__)

HOW_TO_PROVIDE = (
    "provide parallel text as TSV (header: source, target, pair), JSONL or parquet files via "
    "data.train_files=[...] data.valid_files=[...], or run `python train.py "
    "recipe=transformer_quickstart` on generated data"
)


def check_files(paths: Sequence[str] | None, key: str) -> list[Path]:
    """The configured files as paths; ConfigError naming ``key`` for an empty list or a
    missing file, with what to provide.

    Example::

        check_files(["data/train.tsv"], "data.train_files")   # [PosixPath('data/train.tsv')]
    """
    if not paths:
        raise ConfigError(key, f"no files given; {HOW_TO_PROVIDE}")
    resolved = [Path(p).expanduser() for p in paths]
    for path in resolved:
        if not path.is_file():
            raise ConfigError(key, f"{path} not found; {HOW_TO_PROVIDE}")
    return resolved


def generated_files(
    out_dir: Path, languages: int, train_sizes: list[int] | None, eval_size: int, seed: int
) -> tuple[list[Path], list[Path]]:
    """Write (once) the generated corpus into ``out_dir``: ([train.tsv], [valid.tsv]).

    The corpus is deterministic from its arguments, so a resumed run finds the same files.
    """
    train, valid = out_dir / "train.tsv", out_dir / "valid.tsv"
    if not (train.is_file() and valid.is_file()):
        write_synthetic_corpus(
            out_dir,
            num_languages=languages,
            train_sizes=train_sizes,
            eval_size=eval_size,
            seed=seed,
        )
        log.info("generated corpus written to %s", out_dir)
    return [train], [valid]


def load_vocabulary(corpus: Corpus, vocab_dir: Path, vocab_size: int) -> SharedVocabulary:
    """Reuse ``vocab_dir/spm.model`` when present (a resume), else train it on ``corpus``."""
    model_file = vocab_dir / "spm.model"
    reused = model_file.is_file()
    vocab = SharedVocabulary.train_or_load(corpus, vocab_dir, vocab_size=vocab_size)
    if vocab.vocab_size > vocab_size:
        raise ConfigError(
            "data.vocab_size",
            f"{model_file} holds {vocab.vocab_size} pieces, more than the model's "
            f"{vocab_size} outputs; raise data.vocab_size or point data.vocab_dir elsewhere",
        )
    what = "reusing" if reused else "trained"
    log.info("vocabulary: %s %s (%d pieces)", what, model_file, vocab.vocab_size)
    return vocab


def eval_groups(sizes: Sequence[int], max_tokens: int, min_sentences: int) -> list[list[int]]:
    """Indices in length order, cut into batches of ``len * longest <= max_tokens`` holding at
    least ``min_sentences`` each (the pipeline's micro-batches); unlike training, nothing is
    dropped: a short remainder joins the batch before it.

    Example::

        eval_groups([5, 3, 9, 4], max_tokens=10, min_sentences=2)   # [[1, 3], [0, 2]]
    """
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for index in order:
        too_long = (len(current) + 1) * sizes[index] > max_tokens
        if too_long and len(current) >= min_sentences:
            groups.append(current)
            current = []
        current.append(index)
    if len(current) >= min_sentences or not groups:
        groups.append(current)
    else:
        groups[-1].extend(current)
    return [g for g in groups if len(g) >= min_sentences]


def eval_loss_batches(encoded: EncodedCorpus, max_tokens: int, min_sentences: int) -> list[Batch]:
    """The held-out set as fixed ``((src_tokens, tgt_in), tgt_out)`` batches, the pairs taken
    in turn, so that ``trainer.eval_batches=N`` still samples every pair."""
    per_pair: list[list[Batch]] = []
    for pair, rows in sorted(encoded.items()):
        sizes = [example_size(s, t) for s, t in rows]
        collated = [
            collate([rows[i] for i in g], pair)
            for g in eval_groups(sizes, max_tokens, min_sentences)
        ]
        per_pair.append([(b.inputs(), b.tgt_out) for b in collated])
    turns = itertools.zip_longest(*per_pair)
    return [batch for turn in turns for batch in turn if batch is not None]


def training_stream(
    encoded: EncodedCorpus,
    max_tokens: int,
    temperature: float,
    min_sentences: int,
    seed: int,
    position: int,
) -> Iterator[Batch]:
    """Endless ``((src_tokens, tgt_in), tgt_out)`` batches from batch ``position`` on.

    A pure function of (seed, position): the stream is rebuilt and moved on by ``position``
    batches without collating them, so a resume sees what an unbroken run would have seen.
    """
    stream = MultilingualBatches(
        encoded, max_tokens, temperature=temperature, seed=seed, min_sentences=min_sentences
    )
    stream.skip(position)
    for batch in stream:
        yield batch.inputs(), batch.tgt_out


def _non_pad(targets: Tensor, pad_id: int) -> int:
    return int(targets.ne(pad_id).sum())


def _held_out(corpus: Corpus, sentences: int | None) -> Corpus:
    return {pair: rows[:sentences] if sentences else rows for pair, rows in corpus.items()}


def translation(
    train_files: list[str] | None = None,
    valid_files: list[str] | None = None,
    *,
    source_field: str = "source",
    target_field: str = "target",
    pair_field: str = "pair",
    vocab_size: int = 8000,
    vocab_dir: str | None = None,
    max_len: int = 128,
    max_tokens: int = 4096,
    min_sentences: int = 1,
    temperature: float = 5.0,
    generated_languages: int = 3,
    generated_train_sizes: list[int] | None = None,
    generated_eval_size: int = 100,
    generated_seed: int = 0,
    bleu_sentences: int | None = 100,
    beam_size: int = 1,
    length_penalty: float = 0.6,
    run_dir: str | Path | None = None,
) -> DataBundle:
    """The DataBundle of a multilingual translation run (fields: ``TranslationDataConfig``).

    ``run_dir`` (passed by the runner) holds the generated corpus and the vocabulary; without
    one (library use) a fresh temporary directory does.

    Example::

        bundle = translation(["train.tsv"], ["valid.tsv"], max_tokens=4096, run_dir="run")
    """
    work = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="giantpipe-"))
    generated = train_files is None and valid_files is None
    if generated:
        train_paths, valid_paths = generated_files(
            work / "corpus",
            generated_languages,
            generated_train_sizes,
            generated_eval_size,
            generated_seed,
        )
    else:
        train_paths = check_files(train_files, "data.train_files")
        valid_paths = check_files(valid_files, "data.valid_files")
    fields = dict(source_field=source_field, target_field=target_field, pair_field=pair_field)
    train_corpus = load_parallel_corpus(train_paths, **fields)
    valid_corpus = load_parallel_corpus(valid_paths, **fields)
    vocab = load_vocabulary(train_corpus, Path(vocab_dir) if vocab_dir else work, vocab_size)
    train_encoded = encode_corpus(train_corpus, vocab, max_len)
    valid_encoded = encode_corpus(valid_corpus, vocab, max_len=10**9)  # score every sentence
    epoch = MultilingualBatches(
        train_encoded, max_tokens, temperature=temperature, min_sentences=min_sentences
    )
    shares = {
        p: f"{len(train_encoded[p])} ({q:.3f})" for p, q in zip(epoch.pairs, epoch.probabilities)
    }
    log.info("training sentences (sampling probability) per pair: %s", shares)
    eval_set = eval_loss_batches(valid_encoded, max_tokens, min_sentences)
    pad = vocab.pad_id
    scorer = None
    if bleu_sentences != 0:  # the generated corpus puts spaces before "." on purpose: force
        held_out = _held_out(valid_corpus, bleu_sentences)
        scorer = HeldOutBleu(vocab, held_out, beam_size, length_penalty, max_tokens, generated)
    return DataBundle(
        train_batches=lambda seed, position: training_stream(
            train_encoded, max_tokens, temperature, min_sentences, seed, position
        ),
        eval_batches=lambda: eval_set,
        batches_per_epoch=epoch.batches_per_epoch(),
        loss="cross_entropy",
        metric="accuracy",
        ignore_index=pad,
        loss_normalizer=lambda targets: float(_non_pad(targets, pad)),
        tokens_per_batch=lambda batch: _non_pad(batch[1], pad),  # type: ignore[arg-type]
        evaluate_model=scorer,
    )


@dataclass
class TranslationDataConfig:
    """``data=translation``: the arguments of :func:`translation`, checked up front."""

    _target_: str = "giantpipe.data.translation_bundle.translation"
    """Builder called with the other fields (and the run directory)."""
    train_files: list[str] | None = None
    """TSV (header row), JSONL or parquet files of (source, target, pair) rows; null: write the
    generated multilingual corpus into the run directory and train on it."""
    valid_files: list[str] | None = None
    """Held-out files for the eval loss and BLEU (needed with train_files)."""
    source_field: str = "source"
    """Column of the source sentence."""
    target_field: str = "target"
    """Column of the target sentence."""
    pair_field: str = "pair"
    """Column naming the language pair, e.g. ``en-de``."""
    vocab_size: int = 8000
    """Shared SentencePiece vocabulary size (an upper bound; the model's output size)."""
    vocab_dir: str | None = None
    """Where spm.model is trained or reused; null: the run directory (reused on resume)."""
    max_len: int = 128
    """Drop training pairs longer than this many tokens (with markers)."""
    max_tokens: int = 4096
    """Batch size in tokens: sentences x padded length <= max_tokens."""
    min_sentences: int = 1
    """Fewest sentences in a batch (the recipes set it to pipeline.chunks)."""
    temperature: float = 5.0
    """Sampling temperature over language pairs: p ~ (n_pair / N)^(1/T)."""
    generated_languages: int = 3
    """Generated corpus: languages besides English (pairs en-xx and xx-en)."""
    generated_train_sizes: list[int] | None = None
    """Generated corpus: training sentences per language (null: 8000, 2000, 500, ...)."""
    generated_eval_size: int = 100
    """Generated corpus: held-out sentences per direction."""
    generated_seed: int = 0
    """Generated corpus: seed of the languages and sentences."""
    bleu_sentences: int | None = 100
    """Held-out sentences per pair decoded for BLEU at each evaluation (null: all; 0: none)."""
    beam_size: int = 1
    """1: greedy decoding; more: beam search with a GNMT length penalty."""
    length_penalty: float = 0.6
    """Beam search length penalty alpha."""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "max_len", "max_tokens", "min_sentences", "beam_size"):
            check_min(getattr(self, key), 1, f"data.{key}")
        check(self.temperature > 0, "data.temperature", f"must be > 0, got {self.temperature}")
        check_min(self.generated_languages, 1, "data.generated_languages")
        check_min(self.generated_eval_size, 1, "data.generated_eval_size")
        if self.bleu_sentences is not None:
            check_min(self.bleu_sentences, 0, "data.bleu_sentences")
        check(
            self.max_tokens >= self.min_sentences * 4,
            "data.max_tokens",
            f"{self.max_tokens} leaves no room for {self.min_sentences} sentences per batch",
        )
