"""Small models and an un-pipelined reference used by the engine tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from giantpipe.engine.microbatch import scatter
from giantpipe.engine.rng import draw_step_seed, install_rng_hooks, rng_context


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


def reference_step(
    model: nn.Sequential,
    inputs: object,
    targets: torch.Tensor,
    chunks: int,
    seed: int,
    loss_fn: Callable = nn.functional.cross_entropy,
) -> tuple[nn.Sequential, float]:
    """The un-pipelined model run micro-batch by micro-batch (as gradient accumulation would),
    dropout seeded as the engine seeds it. Returns the trained copy and the mini-batch loss."""
    plain = copy.deepcopy(model)
    handles = install_rng_hooks(plain)
    total = float(targets.shape[0])
    loss_sum = 0.0
    for m, (x, y) in enumerate(zip(scatter(inputs, chunks), scatter(targets, chunks))):
        with rng_context(seed, m, torch.device("cpu")):
            loss = loss_fn(plain(x), y) * (y.shape[0] / total)
        loss.backward()
        loss_sum += loss.item()
    for h in handles:
        h.remove()
    return plain, loss_sum


def step_seed(seed: int) -> int:
    """The seed a pipeline step draws right after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return draw_step_seed()
