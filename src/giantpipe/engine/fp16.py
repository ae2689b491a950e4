"""fp16 loss scaling in a pipeline: the scale enters each micro-batch's gradient, and every rank
agrees on the inf/NaN verdict.

fp16 gradients underflow; ``torch.amp.GradScaler`` multiplies the loss by a scale ``S`` before
backward, divides the gradients by ``S`` before the optimizer step, and skips the step (halving
``S``) when a gradient is inf or NaN. A pipeline runs the backward itself, so the scaler is
handed to ``train_step`` and the engine scales each micro-batch's loss::

    caller                       last stage, micro-batch m              every stage
    S = scaler.scale(ones)       L_m = loss_fn(y_m, t_m) * w_m           grads of S * sum L_m
    (a tensor, no host sync)     backward from L_m with gradient S       accumulate in p.grad
    loss = sum L_m  (unscaled)

The scale enters only the gradient (:func:`scale_gradient`; :func:`current_scale` reads ``S``):
backward from ``L_m`` seeded with ``S`` is the backward of ``S * L_m``, bit for bit as
``scaler.scale(loss).backward()``, and the loss the step returns needs no division. Then, as
with the plain model::

    scaler = pipe.grad_scaler()                       # GPipe or DistributedPipe
    with torch.autocast("cuda", dtype=torch.float16):
        loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
    scaler.unscale_(optimizer)                        # only to clip: before the norm
    pipe.clip_grad_norm_(1.0)
    scaler.step(optimizer)                            # skipped if any gradient is inf/NaN
    scaler.update()

A ``GPipe`` holds its parameters on several devices: torch's scaler unscales each device's
gradients and sums their inf checks. A ``DistributedPipe`` rank holds only its own stages, so
its scaler sees only its own gradients. If a stage of one rank overflowed and the others did
not, torch's scaler would skip the step there and take it elsewhere, and the scales would move
apart: the replicas' weights, and the stages of one pipeline, would no longer belong to one
model. Its ``grad_scaler()`` is an :class:`AgreedGradScaler`, which sums each rank's found-inf
over every rank (every pipeline rank and every replica) before anyone decides::

    rank 0 (stage 0)   found_inf 0 --.                   .--> 1: skip, S/2
    rank 1 (stage 1)   found_inf 1 ---+-- all-reduce --> +--> 1: skip, S/2
    rank 2 (stage 0')  found_inf 0 --'                   '--> 1: skip, S/2

One all-reduce of one device tensor per ``unscale_`` (no host sync until ``step`` reads the
verdict, as torch's own scaler does), on the pipe's group over every rank: the pipe makes it
(:class:`AgreeingPipe`, what ``DistributedPipe`` offers), so this module needs no process
group of its own. torch's ``ShardedGradScaler`` (FSDP) does the same per device; this one makes
exactly one collective per rank whatever its devices, and has a verdict even on a rank without
gradients.

Example (``torchrun --nproc_per_node=4``, K=2 x R=2)::

    scaler = pipe.grad_scaler()              # an AgreedGradScaler(pipe)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
    scaler.step(opt)                         # every rank steps, or every rank skips
    scaler.update()                          # the same scale everywhere
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
