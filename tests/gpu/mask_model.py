"""The GPU tests' model: what makes a pipeline hard to get right, in a few layers.

A tuple input whose integer mask rides along between stages, BatchNorm (deferred: running
statistics once per mini-batch) and dropout (seeded per micro-batch by the engine, see
giantpipe.engine.rng)::

    (x, mask) -> Embed -> Block x n -> Head -> logits        Block: h + drop(relu(bn(fc(h)))) * mask

Example::

    sizes = Sizes.of(opts)                        # tiny on CPU stand-ins
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from giantpipe.testing.gpu import GpuOptions
from tests.unit.engine.engine_helpers import Embed, Head  # the engine tests' tuple model's ends


@dataclass(frozen=True)
class Sizes:
    """The mask model's sizes and the batch a test feeds it."""

    d_in: int
    width: int
    blocks: int
    batch: int
    classes: int

    @classmethod
    def of(cls, opts: GpuOptions) -> Sizes:
        if opts.dry:
            return cls(d_in=6, width=16, blocks=6, batch=16, classes=3)
        return cls(d_in=64, width=512, blocks=6, batch=256, classes=10)


class Block(nn.Module):
    """A residual block with BatchNorm and dropout, masked by the carried integer mask.

    Dropout draws its mask for an fp32 tensor even under autocast: a mask depends on the dtype
    it is drawn for, and the bf16/fp16 runs are judged against an fp32 run with the same masks.
    The linear layer has no bias: BatchNorm would cancel it, leaving a gradient of float noise
    whose relative error says nothing.
    """

    def __init__(self, width: int, p: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(p)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h, mask = batch
        update = self.drop(torch.relu(self.bn(self.fc(h))).float())
        return h + update * mask.unsqueeze(-1), mask


def mask_model(sizes: Sizes) -> nn.Sequential:
    """Embed, ``sizes.blocks`` blocks and a head: ``blocks + 2`` layers to cut into stages."""
    torch.manual_seed(0)
    blocks = [Block(sizes.width) for _ in range(sizes.blocks)]
    return nn.Sequential(Embed(sizes.d_in, sizes.width), *blocks, Head(sizes.width, sizes.classes))


def mask_batch(sizes: Sizes) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((features, int64 mask), class targets), on the host."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sizes.batch, sizes.d_in, generator=g)
    mask = torch.randint(0, 2, (sizes.batch,), generator=g)
    return (x, mask), torch.randint(0, sizes.classes, (sizes.batch,), generator=g)


def to(batch: Any, device: torch.device) -> Any:
    """A tensor or a tuple of tensors on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return tuple(to(t, device) for t in batch)
