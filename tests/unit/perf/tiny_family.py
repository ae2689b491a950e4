"""A model family for the sizing tests: an MLP of L hidden layers of width D, built on the meta
device (a :class:`giantpipe.perf.sizing` ``ModelFamily``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from giantpipe.perf.memory import Spec, StageLoss, TensorSpec


class TinyFamily:
    """An MLP of L hidden layers, width D: [in, L x hidden, out] (a ModelFamily)."""

    name = "tiny"
    batch = 8

    def build(self, layers: int, width: int) -> nn.Sequential:
        with torch.device("meta"):
            hidden = [nn.Linear(width, width) for _ in range(layers)]
            return nn.Sequential(nn.Linear(4, width), *hidden, nn.Linear(width, 3))

    def template(self, width: int) -> nn.Sequential:
        return self.build(1, width)

    def expand(self, layers: int) -> list[int]:
        return [0, *[1] * layers, 2]

    def input(self, micro: int) -> Spec:
        return TensorSpec((micro, 4), torch.float32)

    def loss(self, micro: int) -> StageLoss:
        return StageLoss(F.cross_entropy, TensorSpec((micro,), torch.long))

    def describe(self, layers: int, width: int) -> str:
        return f"({layers},{width})"
