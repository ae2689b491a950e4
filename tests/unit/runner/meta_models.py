"""Models a user may write that a run cannot build on the meta device or fill by share: the
targets of tests/unit/runner/test_runner_model.py and of the command-line check of
tests/integration/test_train_cli.py (``model._target_=tests.unit.runner.meta_models.NAME``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Calibrated(nn.Linear):
    """A linear layer that reads a value of its own weight in ``__init__`` (``.item()``)."""

    def __init__(self, features: int) -> None:
        super().__init__(features, features)
        self.scale = float(self.weight.abs().max().item())


def item_in_init(in_features: int = 8, classes: int = 4, **_: Any) -> nn.Sequential:
    """An MLP whose first layer calls ``.item()`` on its weight while it is built."""
    return nn.Sequential(Calibrated(in_features), nn.ReLU(), nn.Linear(in_features, classes))


class Gain(nn.Module):
    """A learnt gain set in ``__init__`` with no ``reset_parameters``: no init reaches it."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def unreached_parameter(in_features: int = 8, classes: int = 4, **_: Any) -> nn.Sequential:
    """An MLP with a :class:`Gain` as its second layer."""
    return nn.Sequential(
        nn.Linear(in_features, in_features), Gain(in_features), nn.Linear(in_features, classes)
    )
