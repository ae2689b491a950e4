"""Loss scaling for fp16: a gradient scaler handed to the step door, on every stage and rank.

fp16 gradients underflow; ``torch.amp.GradScaler`` multiplies the loss by a scale ``S`` before
backward, divides the gradients by ``S`` before the optimizer step, and skips the step (halving
``S``) when a gradient is inf or NaN. A pipeline runs the backward itself, so the scaler is
handed to ``train_step`` and the engine scales each micro-batch's loss::

    caller                       last stage, micro-batch m              every stage
    S = scaler.scale(ones)       L_m = loss_fn(y_m, t_m) * w_m           grads of S * sum L_m
    (a tensor, no host sync)     backward from L_m with gradient S       accumulate in p.grad
    loss = sum L_m  (unscaled)

The scale enters only the gradient (:func:`scale_gradient`): backward from ``L_m`` seeded with
``S`` is the backward of ``S * L_m``, bit for bit as ``scaler.scale(loss).backward()``, and the
loss the step returns needs no division. Then, as with the plain model::

    scaler = pipeline_grad_scaler(pipe)               # GPipe or DistributedPipe
    with torch.autocast("cuda", dtype=torch.float16):
        loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
    scaler.unscale_(optimizer)                        # only to clip: before the norm
    pipe.clip_grad_norm_(1.0)
    scaler.step(optimizer)                            # skipped if any gradient is inf/NaN
    scaler.update()

A ``GPipe`` holds its parameters on several devices: torch's scaler unscales each device's
gradients and sums their inf checks. A ``DistributedPipe`` rank holds only its stages, so its
inf check must be agreed by every rank, or one rank would step while another skips and the
weights would part: :func:`pipeline_grad_scaler` gives it an
:class:`~giantpipe.engine.dist.gradscale.AgreedGradScaler`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from giantpipe.engine.base import Pipe

__all__ = ["current_scale", "pipeline_grad_scaler", "scale_gradient"]


def pipeline_grad_scaler(pipe: Pipe, **kwargs: Any) -> torch.amp.GradScaler:
    """The gradient scaler for ``pipe``: torch's for a GPipe (every stage in this process),
    one whose inf/NaN check every rank agrees on for a DistributedPipe. ``kwargs`` are
    GradScaler's (``init_scale``, ``growth_interval``, ``enabled``, ...).

    Example::

        scaler = pipeline_grad_scaler(pipe, init_scale=2.0**16)
        loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
        scaler.step(optimizer); scaler.update()
    """
    from giantpipe.engine.dist.pipe import DistributedPipe  # torch.distributed: only if asked

    if isinstance(pipe, DistributedPipe):
        from giantpipe.engine.dist.gradscale import AgreedGradScaler

        return AgreedGradScaler(pipe, **kwargs)
    # The scale lives where the loss is (the last stage's device); torch's scaler copies
    # 1/S to each other device's gradients and sums the devices' inf checks.
    device_type = pipe.devices[-1].type if pipe.devices else "cpu"
    return torch.amp.GradScaler(device_type, **kwargs)


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
