"""Re-materialization: which micro-batches drop their activations, and how recompute stays exact.

Modes ``always``, ``except_last`` and ``never`` (torchgpipe's names); a replay draws the same
dropout masks (:mod:`giantpipe.engine.rng`) and leaves BatchNorm's running statistics alone
(:func:`is_recomputing`): docs/engine-internals.md#recompute-stays-exact.

Example::

    >>> recompute_stop("except_last", chunks=4)
    3
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from giantpipe.engine.spec import RECOMPUTE_MODES

MODES = RECOMPUTE_MODES

_local = threading.local()


def recompute_stop(mode: str, chunks: int) -> int:
    """Micro-batches ``m < recompute_stop(...)`` are re-materialized in backward."""
    if mode not in MODES:
        raise ValueError(
            f"recompute must be one of 'always', 'except_last' or 'never', got {mode!r}"
        )
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]


def is_recomputing() -> bool:
    """True while the current thread replays a forward pass for backward.

    Layers with side effects (statistics, counters, caches) use it to act once per step::

        if self.training and not is_recomputing():
            self.num_calls += 1
    """
    return getattr(_local, "recomputing", False)


@contextmanager
def recomputing(stage: nn.Module) -> Iterator[None]:
    """Marks the current thread as recomputing and protects BatchNorm running statistics."""
    saved = _snapshot_batchnorm(stage)
    previous = is_recomputing()
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = previous
        _restore_batchnorm(saved)


def _plain_batchnorms(stage: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [
        m
        for m in stage.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and not getattr(m, "defers_running_stats", False)  # DeferredBatchNorm commits once
        and m.track_running_stats
        and m.training
    ]


def _snapshot_batchnorm(stage: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    saved = []
    for bn in _plain_batchnorms(stage):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            buf = getattr(bn, name)
            if buf is not None:
                saved.append((buf, buf.clone()))
    return saved


def _restore_batchnorm(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    # Through ``.data``: the values go back without moving the buffers' version counters, so
    # the recomputed graph, which saved them at their version after the replay, stays valid.
    with torch.no_grad():
        for buf, copy in saved:
            buf.data.copy_(copy)
