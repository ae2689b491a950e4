"""fp16 loss scaling in a pipeline: the scale enters each micro-batch's gradient, and every rank
agrees on the inf/NaN verdict.

The engine seeds each micro-batch's backward with the scaler's scale (:func:`scale_gradient`),
so ``p.grad`` holds the scaled gradient and the loss returned is unscaled. A
``DistributedPipe``'s :class:`AgreedGradScaler` sums each rank's inf check over every rank in
``unscale_``, blocking the host until that all-reduce is done (on NCCL: has run on the GPU), so
every rank steps or every rank skips: docs/engine-internals.md#fp16-loss-scaling.

Example::

    scaler = pipe.grad_scaler()                       # GPipe or DistributedPipe
    loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
    scaler.unscale_(optimizer); pipe.clip_grad_norm_(1.0)
    scaler.step(optimizer); scaler.update()           # skipped everywhere on inf/NaN
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

__all__ = [
    "AgreedGradScaler",
    "AgreeingPipe",
    "agree_found_inf",
    "check_agreed",
    "current_scale",
    "pipeline_grad_scaler",
    "scale_gradient",
]


class ScalingPipe(Protocol):
    """A pipe that makes its own gradient scaler (GPipe, DistributedPipe)."""

    def grad_scaler(self, **kwargs: Any) -> torch.amp.GradScaler: ...


class AgreeingPipe(Protocol):
    """What an :class:`AgreedGradScaler` asks of its pipe (a ``DistributedPipe``): its device,
    and the in-place sum of a device tensor over every rank of its world, under its timeout
    (``what`` names the sum in a failure)."""

    device: torch.device

    def all_reduce_world_(self, tensor: torch.Tensor, what: str) -> torch.Tensor: ...


def pipeline_grad_scaler(pipe: ScalingPipe, **kwargs: Any) -> torch.amp.GradScaler:
    """The gradient scaler for ``pipe`` (``pipe.grad_scaler(**kwargs)``): torch's for a GPipe
    (every stage in this process), one whose inf/NaN check every rank agrees on for a
    DistributedPipe. ``kwargs`` are GradScaler's (``init_scale``, ``growth_interval``, ...).

    Example::

        scaler = pipeline_grad_scaler(pipe, init_scale=2.0**16)
        loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
        scaler.step(optimizer); scaler.update()
    """
    return pipe.grad_scaler(**kwargs)


def current_scale(
    grad_scaler: torch.amp.GradScaler | None, device: torch.device
) -> torch.Tensor | None:
    """The scaler's scale as a 0-dim float32 tensor on ``device``, without a host sync
    (``scaler.scale`` multiplies by the scale tensor; ``get_scale()`` would read it back);
    None when there is no scaler or it is disabled. Creates the scale on ``device`` on first
    use, as ``scaler.scale(loss)`` does: a rank without the loss then has one to unscale with.

    >>> current_scale(torch.amp.GradScaler("cpu", init_scale=8.0), torch.device("cpu"))
    tensor(8.)
    """
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    # On CUDA the tensor is made on the caller's current stream of ``device``; the worker that
    # reads it runs on that stream, or on one that waits for it before its first action (the
    # local executor's stream joins). Not checkable on CPU: benchmarks/gpu_check.py proves it.
    ones = torch.ones((), dtype=torch.float32, device=device)
    return grad_scaler.scale(ones).reshape(())


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by the scale."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, loss: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        ctx.scale = scale  # a constant of the step, not part of the graph: nothing to save
        return loss.clone()

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        # As the backward of ``loss * scale``: the product, then the input's dtype.
        return (grad * ctx.scale).to(grad.dtype), None


def scale_gradient(loss: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``loss`` itself, whose backward is that of ``loss * scale``: the gradients are scaled,
    the value (what the step returns) is not. ``scale=None`` returns ``loss`` untouched.

    >>> w = torch.tensor(2.0, requires_grad=True)
    >>> loss = scale_gradient(w * 3, torch.tensor(1024.0))
    >>> loss.backward(); loss.item(), w.grad.item()
    (6.0, 3072.0)
    """
    if scale is None:
        return loss
    scaled: torch.Tensor = _ScaleGradient.apply(loss, scale)
    return scaled


class AgreedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` on the pipe's device whose inf/NaN check is summed over every
    rank of the pipe's world. ``kwargs`` are GradScaler's (``init_scale``, ...)."""

    def __init__(self, pipe: AgreeingPipe, **kwargs: Any) -> None:
        super().__init__(pipe.device.type, **kwargs)
        self.pipe = pipe

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # Both of torch's paths come here: unscale_ (and step, which calls it) and the check of
        # an optimizer that unscales itself (fused Adam). The verdict replaces the local one.
        local = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return {self.pipe.device: agree_found_inf(self.pipe, local.values())}


def agree_found_inf(pipe: AgreeingPipe, found: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of ``found`` (this rank's inf checks, one per device) over every rank: > 0
    everywhere if any stage of any rank overflowed. A device tensor, summed by the pipe.

    Example::

        verdict = agree_found_inf(pipe, [torch.zeros((), device=pipe.device)])
    """
    total = torch.zeros((), dtype=torch.float32, device=pipe.device)
    for value in found:
        total += value.to(pipe.device, non_blocking=True)
    return pipe.all_reduce_world_(total, "the gradient scaler's inf/NaN check")


def check_agreed(grad_scaler: torch.amp.GradScaler | None, world_size: int) -> None:
    """Raises TypeError for an enabled scaler whose verdict the ranks would not share (torch's
    own, on a world of more than one rank): it would let one rank step while another skips.

    Example::

        check_agreed(AgreedGradScaler(pipe), dist.get_world_size())     # fine
        check_agreed(torch.amp.GradScaler("cuda"), 2)                    # TypeError
    """
    if grad_scaler is None or not grad_scaler.is_enabled() or world_size == 1:
        return
    if not isinstance(grad_scaler, AgreedGradScaler):
        raise TypeError(
            f"a {type(grad_scaler).__name__} checks only this rank's gradients for inf/NaN, so "
            "ranks could disagree on skipping a step; use "
            "pipe.grad_scaler() (an AgreedGradScaler)"
        )
