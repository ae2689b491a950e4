"""Every replica's share of a batch, and the plain model's step over all of them: what a
:class:`DistributedPipe` with replicas must equal (its loss, and its gradients by name).

Example::

    shards = [(shard(x, r, 2), shard(y, r, 2)) for r in range(2)]
    plain, loss = reference(model, shards, chunks=4, seed=step_seed(5))
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from giantpipe.engine.microbatch import batch_size
from giantpipe.engine.rng import install_rng_hooks, mix
from giantpipe.testing import accumulate_micro_batches


def shard(batch: Any, replica: int, replicas: int) -> Any:
    """Replica ``replica``'s contiguous share of ``batch`` (a tensor, or a tuple whose tensors
    are split alike) among ``replicas``."""
    n = batch_size(batch)
    lo, hi = n * replica // replicas, n * (replica + 1) // replicas
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    return tuple(t[lo:hi] if isinstance(t, torch.Tensor) else t for t in batch)


def reference(
    model: nn.Sequential,
    shards: list[tuple[Any, Any]],
    chunks: int,
    seed: int,
    loss_fn: Callable = nn.functional.cross_entropy,
    normalizer: Callable | None = None,
    accumulate: bool = False,
) -> tuple[nn.Sequential, float]:
    """The plain model over every replica's shard, micro-batch by micro-batch (on a copy, or
    on ``model`` itself with ``accumulate``), each replica under its own dropout seed as
    DistributedPipe seeds it, the losses weighted by the whole batch."""
    plain = model if accumulate else copy.deepcopy(model)
    handles = install_rng_hooks(plain)
    if normalizer is None:
        total = float(sum(batch_size(y) for _, y in shards))
    else:
        total = float(sum(normalizer(y) for _, y in shards))
    loss_sum = 0.0
    for r, (x, y) in enumerate(shards):
        replica_seed = seed if r == 0 else mix(seed, r)
        losses = accumulate_micro_batches(
            plain, x, y, chunks, replica_seed, loss_fn, normalizer, total=total
        )
        for loss in losses:
            loss_sum += loss.item()
    for h in handles:
        h.remove()
    return plain, loss_sum
