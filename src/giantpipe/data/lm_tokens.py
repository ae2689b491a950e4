"""The ``data=lm_tokens`` option: generated token sequences for the decoder-only Transformer-L.

Throughput and memory tables (the paper's Tables 1 and 2) need batches of the right shape, not
real text. These sequences are drawn from a fixed random successor table (each token may be
followed by ``branching`` tokens), so the loss still falls, from ln V towards ln(branching),
and a run shows that it learns.

Example::

    bundle = lm_tokens(vocab_size=32000, seq_len=1024, batch_size=32)
    tokens, next_tokens = next(bundle.train_batches(seed=0, position=0))   # [32, 1024] each
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from giantpipe.data.bundle import Batch, DataBundle

EVAL_STREAM = 1 << 20  # eval batches are drawn as if far past any training position


def successor_table(vocab_size: int, branching: int, seed: int) -> Tensor:
    """[vocab_size, branching] int64: the tokens allowed to follow each token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (vocab_size, branching), generator=generator)


def sequences(table: Tensor, batch_size: int, length: int, generator: torch.Generator) -> Tensor:
    """[batch_size, length] token walks through ``table`` from uniformly drawn first tokens."""
    vocab_size, branching = table.shape
    tokens = torch.empty(batch_size, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    choices = torch.randint(0, branching, (batch_size, length), generator=generator)
    for t in range(1, length):
        tokens[:, t] = table[tokens[:, t - 1], choices[:, t]]
    return tokens


def batch_at(table: Tensor, batch_size: int, seq_len: int, seed: int, index: int) -> Batch:
    """Batch number ``index`` of the stream ``seed``: (tokens, next tokens), [B, seq_len] each."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    walk = sequences(table, batch_size, seq_len + 1, generator)
    return walk[:, :-1].contiguous(), walk[:, 1:].contiguous()


def stream(
    table: Tensor, batch_size: int, seq_len: int, seed: int, position: int
) -> Iterator[Batch]:
    """Endless batches from ``position`` on; each depends only on (seed, its index)."""
    index = position
    while True:
        yield batch_at(table, batch_size, seq_len, seed, index)
        index += 1


def lm_tokens(
    vocab_size: int = 32000,
    seq_len: int = 1024,
    batch_size: int = 32,
    batches_per_epoch: int = 1000,
    eval_batches: int = 2,
    branching: int = 4,
    seed: int = 1234,
) -> DataBundle:
    """Generated language-model batches (fields: ``LMTokensDataConfig``).

    Example::

        bundle = lm_tokens(vocab_size=1000, seq_len=64, batch_size=8)
        bundle.tokens_per_batch(next(bundle.train_batches(0, 0)))      # 512
    """
    table = successor_table(vocab_size, branching, seed)
    held_out = [
        batch_at(table, batch_size, seq_len, seed, EVAL_STREAM + i) for i in range(eval_batches)
    ]
    return DataBundle(
        train_batches=lambda run_seed, position: stream(
            table, batch_size, seq_len, run_seed, position
        ),
        eval_batches=lambda: held_out,
        batches_per_epoch=batches_per_epoch,
        loss="cross_entropy",
        metric="accuracy",
        tokens_per_batch=lambda batch: batch[1].numel(),  # type: ignore[union-attr]
    )
