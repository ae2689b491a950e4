"""The ``data=text`` option: your own text as language-model batches.

:func:`text` reads ``data.files``, cuts documents, holds out ``data.valid_fraction``, trains or
loads the tokenizer and packs each split into ``data.seq_len`` + 1 token rows
(docs/text-data.md#what-it-reads); the held-out perplexity is ``exp(eval/loss)``, and
:func:`unigram_perplexity` the baseline a model must beat.

Example::

    bundle = text(files=["corpus/*.txt"], seq_len=64, batch_size=8, vocab_size=500)
    tokens, next_tokens = next(bundle.train_batches(0, 0))        # [8, 64] each
    bundle.vocab.decode(tokens[0].tolist())                       # the text back
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from giantpipe.config import ConfigError
from giantpipe.data.batch_order import sequential_batches, shuffled_batches
from giantpipe.data.bundle import DataBundle
from giantpipe.data.text.files import content_hash, expand_files, read_documents
from giantpipe.data.text.packing import pack, unigram_perplexity
from giantpipe.data.text.split import held_out
from giantpipe.data.text.vocabulary import Vocabulary, cache_dir_for, vocabulary

log = logging.getLogger(__name__)


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
    """What data=text reads, in order: files -> documents -> split -> tokens -> rows.

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
