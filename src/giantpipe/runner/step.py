"""One optimizer step's worth of engine steps: gradient accumulation with exact scaling.

With ``A`` batches per optimizer step, each engine step's loss is weighted so the accumulated
gradients equal those of one batch made of all ``A``: by batch size for mean losses, or by the
combined normalizer (e.g. total non-pad tokens) for summed losses.

Example::

    loss, stats = accumulate_gradients(pipe, batches, loss_fn, normalizer=None,
                                       precision="fp32", devices=["cpu", "cpu"])
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from giantpipe.data.bundle import Batch, Tensors, batch_size
from giantpipe.engine import GPipe
from giantpipe.runner.losses import LossFn


def to_device(tensors: Tensors, device: str | torch.device) -> Tensors:
    """Move a tensor or a tuple of tensors (non-blocking where the copy allows it)."""
    if isinstance(tensors, tuple):
        return tuple(t.to(device, non_blocking=True) for t in tensors)
    return tensors.to(device, non_blocking=True)


def autocast(precision: str, device: str) -> torch.autocast:
    """bf16 autocast on the devices' type, or a disabled (no-op) autocast for fp32."""
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _weighted(loss_fn: LossFn, weight: float) -> LossFn:
    def weighted(output: Tensor, target: Tensor) -> Tensor:
        return loss_fn(output, target.to(output.device)) * weight

    return weighted


def accumulate_gradients(
    pipe: GPipe,
    batches: Sequence[Batch],
    loss_fn: LossFn,
    normalizer: Callable[[Any], float] | None,
    precision: str,
    devices: Sequence[str],
) -> tuple[float, list[Any]]:
    """Run ``pipe.train_step`` on each batch; grads add up in ``p.grad``.

    Returns the combined batch's loss and the engine's stats of each engine step.
    """
    sizes = [batch_size(inputs) for inputs, _ in batches]
    total_norm = sum(normalizer(t) for _, t in batches) if normalizer is not None else None
    loss, stats = 0.0, []
    for (inputs, targets), size in zip(batches, sizes, strict=True):
        inputs, targets = to_device(inputs, devices[0]), to_device(targets, devices[-1])
        if total_norm is None:
            step_fn, step_norm = _weighted(loss_fn, size / sum(sizes)), None
        else:
            # The engine divides the summed loss by this number: the combined batch's tokens.
            step_fn, step_norm = _weighted(loss_fn, 1.0), (lambda _t, n=total_norm: n)
        with autocast(precision, devices[0]):
            step_loss = pipe.train_step(inputs, targets, step_fn, loss_normalizer=step_norm)
        loss += float(step_loss)
        stats.append(pipe.last_stats)
    return loss, stats
