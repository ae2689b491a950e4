"""Deferred batch norm: running statistics of the whole mini-batch, not of each micro-batch.

In training every micro-batch is normalised with its own statistics (as the paper does), but a
plain BatchNorm would also move its running mean/var once per micro-batch, M times per step,
each time towards a noisier estimate. :class:`DeferredBatchNorm` instead accumulates the
micro-batches' statistics and commits them once per mini-batch, so the running statistics equal
those of the un-pipelined model trained on the whole mini-batch.

Example::

    >>> model = convert_deferred_batch_norm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))
    >>> for x in torch.randn(32, 3, 8, 8).chunk(4):
    ...     _ = model(x)
    >>> commit_deferred_batch_norm(model)  # the engine does this once per step
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from giantpipe.engine.recompute import is_recomputing


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose running statistics are updated once per mini-batch by :meth:`commit`."""

    defers_running_stats = True
    """Recompute (:mod:`giantpipe.engine.recompute`) leaves such layers alone: they skip the
    accumulation themselves while :func:`is_recomputing`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._reset_accumulator()

    def _reset_accumulator(self) -> None:
        self._count = 0
        self._mean: torch.Tensor | None = None
        self._m2: torch.Tensor | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        if not is_recomputing():
            self._accumulate(input.detach())
        return F.batch_norm(
            input, None, None, self.weight, self.bias, training=True, momentum=0.0, eps=self.eps
        )

    def _accumulate(self, x: torch.Tensor) -> None:
        # Chan et al.'s parallel variance: merge (count, mean, M2) of each micro-batch, stable
        # where E[x^2] - E[x]^2 would cancel.
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.shape[1]
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
        if self._mean is None or self._m2 is None:
            self._count, self._mean, self._m2 = n, mean, var * n
            return
        total = self._count + n
        delta = mean - self._mean
        self._mean = self._mean + delta * (n / total)
        self._m2 = self._m2 + var * n + delta.square() * (self._count * n / total)
        self._count = total

    @torch.no_grad()
    def commit(self) -> None:
        """Moves the running statistics once, by the accumulated mini-batch statistics."""
        if self._mean is None or self._m2 is None or self.running_mean is None:
            return
        assert self.running_var is not None and self.num_batches_tracked is not None
        self.num_batches_tracked += 1
        if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            factor = self.momentum
        unbiased = self._m2 / max(self._count - 1, 1)
        self.running_mean.lerp_(self._mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        self._reset_accumulator()

    @classmethod
    def convert(cls, module: nn.modules.batchnorm._BatchNorm) -> DeferredBatchNorm:
        """A DeferredBatchNorm with ``module``'s settings, parameters and buffers."""
        new = cls(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
        )
        # the module's own tensors, taken as they are: their device and type, or the meta device
        # of a model built without its parameters (made real later, in place)
        new.load_state_dict(module.state_dict(), assign=True)
        new.train(module.training)
        return new


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Replaces every ``nn.BatchNorm1d/2d/3d`` inside ``module`` by a DeferredBatchNorm.

    Parameter and buffer names are unchanged, so state dicts stay interchangeable with the
    plain model. Returns ``module`` (or the replacement, if ``module`` itself is a BatchNorm).
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, (DeferredBatchNorm, nn.SyncBatchNorm)
    ):
        return DeferredBatchNorm.convert(module)
    for name, child in module.named_children():
        replaced = convert_deferred_batch_norm(child)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def merge_deferred_batch_norm(
    module: nn.Module, all_reduce_sum: Callable[[torch.Tensor], object]
) -> None:
    """Merges each DeferredBatchNorm's pending statistics with its replicas', before commit.

    ``all_reduce_sum`` sums a tensor in place over the replicas (e.g. ``dist.all_reduce`` on the
    stage's replica group). After the merge every replica holds the (count, mean, M2) of the
    whole mini-batch across replicas, so the committed running statistics equal those of the
    un-replicated model on that mini-batch, and replicas never drift apart. Two reductions for
    the whole module, whatever the number of layers (counts and means first, then M2 about the
    merged mean: exact, and stable where sums of squares would cancel).

    Example::

        merge_deferred_batch_norm(stage, lambda t: dist.all_reduce(t, group=replicas))
        commit_deferred_batch_norm(stage)
    """
    norms = [
        m
        for m in module.modules()
        if isinstance(m, DeferredBatchNorm) and m._mean is not None and m._m2 is not None
    ]
    if not norms:
        return
    device = norms[0]._mean.device  # type: ignore[union-attr]
    counts = torch.tensor([float(m._count) for m in norms], dtype=torch.float64, device=device)
    sums = torch.cat([m._mean.double() * m._count for m in norms])  # type: ignore[union-attr]
    first = torch.cat([counts, sums])
    all_reduce_sum(first)
    total, merged_sums = (
        first[: len(norms)],
        first[len(norms) :].split([m.num_features for m in norms]),
    )
    means = [s / n for s, n in zip(merged_sums, total, strict=True)]
    spread = torch.cat(
        [
            m._m2.double() + m._count * (m._mean.double() - mean).square()  # type: ignore[union-attr]
            for m, mean in zip(norms, means, strict=True)
        ]
    )
    all_reduce_sum(spread)
    for m, n, mean, m2 in zip(
        norms, total, means, spread.split([m.num_features for m in norms]), strict=True
    ):
        m._count = int(n.item())
        m._mean, m._m2 = mean.float(), m2.float()


def commit_deferred_batch_norm(module: nn.Module) -> None:
    """Commits every DeferredBatchNorm in ``module`` (once per mini-batch)."""
    for sub in module.modules():
        if isinstance(sub, DeferredBatchNorm):
            sub.commit()
