"""The global-norm clip of a distributed pipe: every stage and every replica's shard counted once,
equal to ``torch.nn.utils.clip_grad_norm_`` on the plain model, without a host sync.

Each rank sums its local shards' ``|g|^p``, one all-reduce adds up the model, and every local
gradient takes the same clamped coefficient, all on the device
(docs/engine-internals.md#the-distributed-steps-collectives).

Example::

    loss = pipe.train_step(x, y, loss_fn)
    norm = clip_grad_norm_(pipe, max_norm=1.0)     # what pipe.clip_grad_norm_(1.0) does
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | Any,
    max_norm: float,
    norm_type: float = 2.0,
    group: Any = None,
    uncounted: Iterable[torch.Tensor] = (),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Clips gradients by their norm over every stage and replica; returns that norm.

    ``parameters`` are this rank's (``pipe.parameters()``; or pass the pipe itself, whose
    group, tied copies and device are then used). ``group`` must serve the gradients' device
    (NCCL on CUDA) and hold every rank whose gradients count: the pipeline without replicas,
    the world with them. ``uncounted``: tied copies whose gradient is scaled but counted where
    their first stage is. ``device`` is where the norm lives when this rank has no gradient
    (default: the first parameter's device).

    >>> w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.full((4,), 3.0)
    >>> clip_grad_norm_([w], max_norm=1.0)
    tensor(6.)
    >>> w.grad
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    """
    if hasattr(parameters, "norm_group") and hasattr(parameters, "parameters"):
        group = parameters.norm_group() if group is None else group
        uncounted = parameters.tied.followers() if hasattr(parameters, "tied") else uncounted
        device = getattr(parameters, "device", None) if device is None else device
        parameters = parameters.parameters()
    skip = {id(p) for p in uncounted}  # a tied copy's gradient: scaled, but counted once
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    counted = [_counted(p.grad) for p in params if p.grad is not None and id(p) not in skip]
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    # An FSDP2 shard may be empty (a parameter with fewer rows than replicas).
    mine = [g for g in counted if g is not None and g.numel() > 0]
    local = _local_norm(mine, norm_type, torch.device(device))
    total = local.reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    norm = total[0] if inf else total[0].pow(1.0 / norm_type)
    # As torch's: a coefficient of exactly 1.0 under the limit leaves every gradient bit for bit.
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        local_grad = g.to_local() if isinstance(g, DTensor) else g
        local_grad.detach().mul_(coef.to(local_grad.device, local_grad.dtype))
    return norm.float()


def _counted(grad: torch.Tensor) -> torch.Tensor | None:
    """What of ``grad`` this rank counts: a DTensor's local shard; a replicated DTensor's whole
    value on the first rank of its mesh only (None elsewhere); any other tensor itself."""
    if not isinstance(grad, DTensor):
        return grad
    if all(isinstance(p, Replicate) for p in grad.placements):
        return grad.to_local() if grad.device_mesh.get_local_rank() == 0 else None
    return grad.to_local()


def _local_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share of the norm in float64 on ``device``: the max (inf) or the sum of
    ``|g|^p`` over ``grads``; 0 with none."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    inf = norm_type == float("inf")
    norms = torch.stack(
        [(g.detach().abs().max() if inf else g.detach().norm(norm_type)).to(device) for g in grads]
    ).double()
    return norms.max() if inf else norms.pow(norm_type).sum()
