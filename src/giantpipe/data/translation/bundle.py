"""The ``data=translation`` option: multilingual parallel text as a DataBundle for the runner.

:func:`translation` reads your files (or writes the generated corpus), trains or reuses the
shared vocabulary, samples token-bucketed batches by temperature, normalizes the loss by target
tokens and evaluates BLEU by decoding (docs/your-data.md#translation).

Example::

    bundle = translation(max_tokens=1024, min_sentences=4, run_dir="outputs/run")
    (src_tokens, tgt_in), tgt_out = next(bundle.train_batches(0, 0))
    bundle.evaluate_model(model)        # {"bleu": 12.3, "bleu/en-xa": 15.1, ...}
"""

from __future__ import annotations

import itertools
import logging
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from torch import Tensor

from giantpipe.config import ConfigError
from giantpipe.data.bundle import Batch, DataBundle
from giantpipe.data.translation.batches import MultilingualBatches, collate, example_size
from giantpipe.data.translation.bleu import HeldOutBleu
from giantpipe.data.translation.files import Corpus, CorpusError, load_parallel_corpus, split_pair
from giantpipe.data.translation.generated import write_synthetic_corpus
from giantpipe.data.translation.vocabulary import (
    EncodedCorpus,
    SharedVocabulary,
    encode_corpus,
    fits,
    lang_token,
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


def read_corpus(
    paths: Sequence[Path], key: str, fields: Mapping[str, str]
) -> tuple[Corpus, dict[str, list[str]]]:
    """The sentence pairs of ``paths`` and, per language pair, the files that hold it. A file
    that cannot be read is one ConfigError naming ``key``, the file and the line.

    Example::

        corpus, origin = read_corpus([Path("valid.tsv")], "data.valid_files", {})
        origin["en-de"]                          # ["valid.tsv"]
    """
    corpus: Corpus = {}
    origin: dict[str, list[str]] = {}
    for path in paths:
        try:
            part = load_parallel_corpus([path], **fields)
        except CorpusError as err:
            raise ConfigError(key, str(err)) from err
        for pair, rows in part.items():
            corpus.setdefault(pair, []).extend(rows)
            origin.setdefault(pair, []).append(str(path))
    return corpus, origin


def zero_shot_pairs(
    origin: Mapping[str, list[str]], trained: Iterable[str], vocab: SharedVocabulary, allow: bool
) -> frozenset[str]:
    """The held-out pairs that no training file holds, allowed only with ``allow``
    (``data.zero_shot``). Without it such a pair is a ConfigError naming the pair and its files;
    with it, a pair whose target language no training file has is still one (its ``<2xx>``
    token would read as ``<unk>``).

    Example::

        zero_shot_pairs({"de-fr": ["valid.tsv"]}, ["en-de", "en-fr"], vocab, allow=True)
        # frozenset({'de-fr'}): both languages were trained, the pair was not
    """
    unseen = sorted(set(origin) - set(trained))
    for pair in unseen:
        files, target = ", ".join(origin[pair]), split_pair(pair)[1]
        if vocab.lang_id(target) == vocab.unk_id:
            raise ConfigError(
                "data.valid_files",
                f"{files}: pair {pair!r} translates into {target!r}, a language no file of "
                f"data.train_files holds, so the vocabulary has no {lang_token(target)} token; "
                f"add {target} text to the training files or remove the pair",
            )
        if not allow:
            raise ConfigError(
                "data.valid_files",
                f"{files}: pair {pair!r} never appears in data.train_files (trained: "
                f"{', '.join(sorted(trained))}); remove it, or set data.zero_shot=true to "
                "evaluate it zero-shot, reported as eval/bleu_zero_shot apart from eval/bleu",
            )
    return frozenset(unseen)


def split_long(encoded: EncodedCorpus, max_len: int) -> tuple[EncodedCorpus, int]:
    """(the examples that :func:`~giantpipe.data.translation.vocabulary.fits` ``max_len``, how
    many did not).

    Example::

        kept, long = split_long({"en-de": [([5, 9, 3], [7])]}, max_len=2)   # ({"en-de": []}, 1)
    """
    kept = {pair: [r for r in rows if fits(*r, max_len)] for pair, rows in encoded.items()}
    dropped = sum(len(rows) for rows in encoded.values()) - sum(map(len, kept.values()))
    return kept, dropped


def training_examples(corpus: Corpus, vocab: SharedVocabulary, max_len: int) -> EncodedCorpus:
    """The training pairs, encoded; those longer than ``max_len`` tokens left out and counted."""
    kept, dropped = split_long(encode_corpus(corpus, vocab, None), max_len)
    if dropped:
        total = sum(map(len, corpus.values()))
        log.warning(
            "training: %d of %d sentence pairs are longer than data.max_len=%d tokens and are "
            "left out",
            dropped,
            total,
            max_len,
        )
    return kept


def held_out_examples(
    corpus: Corpus, vocab: SharedVocabulary, max_len: int, eval_set: str
) -> EncodedCorpus:
    """The held-out pairs for the eval loss, encoded: those longer than ``max_len`` tokens (the
    model has no positions for them) left out and counted; BLEU cuts their sources instead."""
    kept, dropped = split_long(encode_corpus(corpus, vocab, None), max_len)
    if dropped:
        total = sum(map(len, corpus.values()))
        log.warning(
            "held-out (%s): %d of %d sentence pairs are longer than data.max_len=%d tokens: left "
            "out of the eval loss; BLEU translates their first %d source tokens",
            eval_set,
            dropped,
            total,
            max_len,
            max_len,
        )
    return {pair: rows for pair, rows in kept.items() if rows}


def sampling_epoch(
    encoded: EncodedCorpus, max_tokens: int, temperature: float, min_sentences: int
) -> MultilingualBatches:
    """The training stream's first epoch (its length is the bundle's epoch), logged per pair;
    a ConfigError when no pair has a batch that fits ``data.max_tokens``."""
    try:
        epoch = MultilingualBatches(
            encoded, max_tokens, temperature=temperature, min_sentences=min_sentences
        )
    except ValueError as err:
        raise ConfigError("data.max_tokens", f"{err}; raise it or data.max_len") from err
    shares = {p: f"{len(encoded[p])} ({q:.3f})" for p, q in zip(epoch.pairs, epoch.probabilities)}
    log.info("training sentences (sampling probability) per pair: %s", shares)
    return epoch


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
    zero_shot: bool = False,
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
        generator = (generated_languages, generated_train_sizes, generated_eval_size)
        train_paths, valid_paths = generated_files(work / "corpus", *generator, generated_seed)
    else:
        train_paths = check_files(train_files, "data.train_files")
        valid_paths = check_files(valid_files, "data.valid_files")
    fields = dict(source_field=source_field, target_field=target_field, pair_field=pair_field)
    train_corpus, _ = read_corpus(train_paths, "data.train_files", fields)
    valid_corpus, origin = read_corpus(valid_paths, "data.valid_files", fields)
    vocab = load_vocabulary(train_corpus, Path(vocab_dir) if vocab_dir else work, vocab_size)
    unseen = zero_shot_pairs(origin, train_corpus, vocab, zero_shot)
    eval_name = ", ".join(str(p) for p in valid_paths)
    train_encoded = training_examples(train_corpus, vocab, max_len)
    seen_valid = {p: rows for p, rows in valid_corpus.items() if p not in unseen}
    eval_set = eval_loss_batches(
        held_out_examples(seen_valid, vocab, max_len, eval_name), max_tokens, min_sentences
    )
    epoch = sampling_epoch(train_encoded, max_tokens, temperature, min_sentences)
    scorer = None
    if bleu_sentences != 0:  # the generated corpus puts spaces before "." on purpose: force
        held_out = _held_out(valid_corpus, bleu_sentences)
        scorer = HeldOutBleu(
            vocab, held_out, beam_size, length_penalty, max_tokens, generated,
            max_source_len=max_len, zero_shot=unseen, eval_set=eval_name,
        )  # fmt: skip
    pad = vocab.pad_id
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
        eval_set=eval_name,
    )
