"""fp16 loss scaling under torchrun: one inf/NaN verdict for every rank of the world.

A rank holds only its own stages, so its scaler sees only its own gradients. If a stage of one
rank overflowed and the others did not, torch's scaler would skip the step there and take it
elsewhere, and the scales would move apart: the replicas' weights, and the stages of one
pipeline, would no longer belong to one model. :class:`AgreedGradScaler` sums each rank's
found-inf over every rank (every pipeline rank and every replica) before anyone decides::

    rank 0 (stage 0)   found_inf 0 --.                   .--> 1: skip, S/2
    rank 1 (stage 1)   found_inf 1 ---+-- all-reduce --> +--> 1: skip, S/2
    rank 2 (stage 0')  found_inf 0 --'                   '--> 1: skip, S/2

One all-reduce of one device tensor per ``unscale_`` (no host sync until ``step`` reads the
verdict, as torch's own scaler does), on the pipe's group over every rank. torch's
``ShardedGradScaler`` (FSDP) does the same per device; this one makes exactly one collective
per rank whatever its devices, and has a verdict even on a rank without gradients.

Example (``torchrun --nproc_per_node=4``, K=2 x R=2)::

    scaler = AgreedGradScaler(pipe)          # or giantpipe.engine.lossscale.pipeline_grad_scaler
    with torch.autocast("cuda", dtype=torch.float16):
        loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
    scaler.step(opt)                         # every rank steps, or every rank skips
    scaler.update()                          # the same scale everywhere
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from giantpipe.engine.dist.gradsync import all_reduce_

if TYPE_CHECKING:
    from giantpipe.engine.dist.pipe import DistributedPipe

__all__ = ["AgreedGradScaler", "check_agreed"]


class AgreedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` on the pipe's device whose inf/NaN check is summed over every
    rank of the pipe's world. ``kwargs`` are GradScaler's (``init_scale``, ...)."""

    def __init__(self, pipe: DistributedPipe, **kwargs: Any) -> None:
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


def agree_found_inf(pipe: DistributedPipe, found: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of ``found`` (this rank's inf checks, one per device) over every rank: > 0
    everywhere if any stage of any rank overflowed. A device tensor on the device group.

    Example::

        verdict = agree_found_inf(pipe, [torch.zeros((), device=pipe.device)])
    """
    total = torch.zeros((), dtype=torch.float32, device=pipe.device)
    for value in found:
        total += value.to(pipe.device, non_blocking=True)
    group = pipe.groups.p2p  # every rank of the world, on the device's backend
    if group is None:
        raise RuntimeError("the pipeline failed earlier; its ranks can no longer agree")
    what = "the gradient scaler's inf/NaN check"
    return all_reduce_(total, group, pipe.timeout, pipe.board, what)


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
            "giantpipe.engine.lossscale.pipeline_grad_scaler(pipe) (an AgreedGradScaler)"
        )
