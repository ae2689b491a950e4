"""Small models used by the engine tests (their plain reference step: giantpipe.testing)."""

from __future__ import annotations

import torch
from torch import nn


class Embed(nn.Module):
    """(features, mask) -> (hidden, mask): the mask is an int tensor riding along."""

    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, mask = batch
        return self.proj(x), mask


class Block(nn.Module):
    """Residual block with BatchNorm and dropout, masked by the carried int mask."""

    def __init__(self, d: int, p: float = 0.2) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(p)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h, mask = batch
        return h + self.drop(torch.relu(self.bn(self.fc(h)))) * mask.unsqueeze(-1), mask


class Head(nn.Module):
    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, classes)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, _ = batch
        return self.fc(h)


def tuple_model(num_blocks: int = 4, d_in: int = 6, d: int = 16, classes: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(d_in, d), *[Block(d) for _ in range(num_blocks)], Head(d, classes))


def tuple_batch(n: int = 14, d_in: int = 6, classes: int = 3) -> tuple:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d_in, generator=g)
    mask = torch.randint(0, 2, (n,), generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return (x, mask), y
