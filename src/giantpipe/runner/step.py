"""One optimizer step's worth of engine steps: gradient accumulation with exact scaling.

Each engine step's loss is weighted so the accumulated gradients equal those of one batch made
of all A, and each process feeds only what its stages need, its replica's slice
(docs/architecture.md#one-runner-for-both-executors). fp16: pass the run's scaler, unscale
before clipping, step through it.

Example::

    loss, stats = accumulate_gradients(pipe, batches, loss_fn, normalizer=None,
                                       precision="fp32", devices=["cpu", "cpu"])
    norm = pipe.clip_grad_norm_(1.0)
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from giantpipe.data.bundle import Batch, Tensors, batch_size
from giantpipe.engine.pipe import Pipe
from giantpipe.runner.losses import LossFn


def to_device(tensors: Tensors, device: str | torch.device) -> Tensors:
    """Move a tensor or a tuple of tensors (non-blocking where the copy allows it)."""
    if isinstance(tensors, tuple):
        return tuple(t.to(device, non_blocking=True) for t in tensors)
    return tensors.to(device, non_blocking=True)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast type of each reduced precision (fp32: none)."""


def autocast(precision: str, device: str) -> torch.autocast:
    """bf16 or fp16 autocast on the devices' type, or a disabled (no-op) autocast for fp32.

    Example::

        with autocast("fp16", "cuda:0"):
            loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
    """
    device_type = torch.device(device).type
    dtype = AUTOCAST_DTYPES.get(precision)
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def replica_slice(tensors: Tensors, replica: int, replicas: int) -> Tensors:
    """Replica ``replica``'s share of a batch: slice ``replica`` of ``replicas`` along dim 0.

    Example::

        replica_slice(torch.arange(10), 1, 2)    # tensor([5, 6, 7, 8, 9])
    """
    if replicas == 1:
        return tensors

    def cut(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor_split(t, replicas)[replica]

    return tuple(cut(t) for t in tensors) if isinstance(tensors, tuple) else cut(tensors)


def _weighted(loss_fn: LossFn, weight: float) -> LossFn:
    def weighted(output: Tensor, target: Tensor) -> Tensor:
        return loss_fn(output, target.to(output.device)) * weight

    return weighted


def _fixed(value: float) -> Callable[[Any], float]:
    return lambda _targets: value


def accumulate_gradients(
    pipe: Pipe,
    batches: Sequence[Batch | None],
    loss_fn: LossFn,
    normalizer: Callable[[Any], float] | None,
    precision: str,
    devices: Sequence[str],
    grad_scaler: torch.amp.GradScaler | None = None,
) -> tuple[float, list[Any]]:
    """Run ``pipe.train_step`` on each batch; grads add up in ``p.grad``.

    ``devices``: inputs go to the first, targets to the last. Returns the combined batch's loss
    and the engine's stats of each engine step. Mean losses: batch ``i`` weighs its size over
    the step's; summed losses: the engine divides by the step's normalizer (over every batch
    of the step and, under torchrun, every replica). ``grad_scaler`` (fp16): the gradients
    are scaled by its scale, the loss returned is not.
    """
    r, replicas = pipe.replica, pipe.replicas
    held = [b for b in batches if b is not None]
    sizes = [0 if b is None else batch_size(b[1]) for b in batches]
    share = (
        sum(normalizer(replica_slice(t, r, replicas)) for _, t in held)
        if normalizer is not None and pipe.needs_targets
        else None
    )
    loss, stats = 0.0, []
    for index, batch in enumerate(batches):
        inputs = targets = None
        step_fn, step_norm = _weighted(loss_fn, 1.0), None
        if batch is not None:
            if pipe.needs_inputs:
                inputs = to_device(replica_slice(batch[0], r, replicas), devices[0])
            if pipe.needs_targets:
                targets = to_device(replica_slice(batch[1], r, replicas), devices[-1])
            if normalizer is None:
                step_fn = _weighted(loss_fn, sizes[index] / sum(sizes))
            elif share is not None:
                step_norm = _fixed(share)
        with autocast(precision, devices[0]):
            step_loss = pipe.train_step(
                inputs, targets, step_fn, loss_normalizer=step_norm, grad_scaler=grad_scaler
            )
        loss += float(step_loss)
        stats.append(pipe.last_stats)
    return loss, stats
