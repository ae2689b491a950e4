"""The planner's measurements of the run's own model: shapes on the meta device, layer times.

``pipeline.plan=auto`` (:mod:`giantpipe.runner.planning`) measures bytes per layer on a meta
copy of the model and one meta sample, and seconds per layer with :class:`LayerTimer`.

Example::

    layers = per_sample(measure_layers(meta_copy(model), meta_sample(inputs, 2)), 2)
    timer = LayerTimer(model, "cpu", inputs, targets, loss_fn, threads=1)
    timer.calibrate([8, 64])
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from giantpipe.data.bundle import Tensors
from giantpipe.engine.recompute import recomputing
from giantpipe.engine.rng import rng_context
from giantpipe.perf.simulate import StageCost
from giantpipe.perf.stage_profile import profile_stages
from giantpipe.plan import LayerCost
from giantpipe.runner.losses import LossFn


def meta_copy(model: nn.Sequential) -> nn.Sequential:
    """The model on the meta device (shapes only), copied one layer at a time."""
    return nn.Sequential(*[copy.deepcopy(layer).to("meta") for layer in model]).train()


def meta_sample(inputs: Tensors, n: int = 1) -> Tensors:
    """The first ``n`` samples of ``inputs`` on the meta device."""
    if isinstance(inputs, tuple):
        return tuple(torch.empty_like(t[:n], device="meta") for t in inputs)
    return torch.empty_like(inputs[:n], device="meta")


def per_sample(layers: list[LayerCost], n: int) -> list[LayerCost]:
    """Costs measured on ``n`` samples (BatchNorm needs 2 in training) as costs of one."""
    if n == 1:
        return layers
    return [
        replace(
            c,
            flops=c.flops / n,
            input_bytes=c.input_bytes // n,
            saved_bytes=c.saved_bytes // n,
            input_saved=c.input_saved // n,
            output_bytes=c.output_bytes // n,
        )
        for c in layers
    ]


class LayerTimer:
    """Seconds per layer on ``device`` for a micro-batch of n samples: measured at a few sizes
    (:meth:`calibrate`), linear in n between and beyond them. Each layer runs as the executor
    runs a stage (:func:`giantpipe.perf.stage_profile.profile_stages`); a layer not on
    ``device`` is profiled on a copy. The loss runs after the last layer.

    Example::

        timer = LayerTimer(model, "cpu", inputs, targets, loss_fn, threads=1)
        timer.calibrate([8, 64])
        timer(16)   # [(forward_s, input_grad_s, weight_grad_s), ...] per layer
    """

    def __init__(
        self,
        model: nn.Sequential,
        device: str,
        inputs: Tensors,
        targets: Tensors,
        loss_fn: LossFn,
        threads: int | None,
        repeats: int = 2,
    ) -> None:
        self.model, self.device = model, torch.device(device)
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.threads, self.repeats = threads, repeats
        self.points: dict[int, list[StageCost]] = {}

    def calibrate(self, sizes: Sequence[int]) -> None:
        for n in sorted(set(sizes)):
            self.points[n] = self.profile(n)

    def profile(self, n: int) -> list[StageCost]:
        """Every layer's measured cost on the first ``n`` samples."""
        x: Any = _to(_head(self.inputs, n), self.device)
        target = _head(self.targets, n)
        costs = []
        for i, layer in enumerate(self.model):
            on_device = all(p.device == self.device for p in layer.parameters())
            stage = nn.Sequential(layer if on_device else copy.deepcopy(layer).to(self.device))
            last = i == len(self.model) - 1
            stage_in = x if i == 0 else _wanting_grad(x)  # a leaf that needs its input gradient
            costs += profile_stages(
                [stage],
                [self.device],
                stage_in,
                target if last else None,
                self.loss_fn if last else None,
                repeats=self.repeats,
                threads=self.threads,
            )
            if not last:
                with torch.no_grad(), recomputing(stage), rng_context(0, 0, self.device):
                    x = stage(x)
        return costs

    def __call__(self, n: int) -> list[tuple[float, float, float]]:
        sizes = sorted(self.points)
        lo, hi = sizes[0], sizes[-1]
        if lo == hi:
            return [(c.forward, c.backward_input, c.weight) for c in self.points[lo]]
        share = (n - lo) / (hi - lo)

        def at(a: float, b: float) -> float:
            return max(0.0, a + (b - a) * share)

        return [
            (
                at(a.forward, b.forward),
                at(a.backward_input, b.backward_input),
                at(a.weight, b.weight),
            )
            for a, b in zip(self.points[lo], self.points[hi], strict=True)
        ]


def _head(tensors: Tensors, n: int) -> Tensors:
    return tuple(t[:n] for t in tensors) if isinstance(tensors, tuple) else tensors[:n]


def _to(tensors: Tensors, device: torch.device) -> Tensors:
    if isinstance(tensors, tuple):
        return tuple(t.to(device) for t in tensors)
    return tensors.to(device)


def _wanting_grad(x: Any) -> Any:
    def leaf(t: Any) -> Any:
        if not torch.is_tensor(t):
            return t
        return t.detach().requires_grad_(t.is_floating_point())

    return leaf(x) if torch.is_tensor(x) else tuple(leaf(t) for t in x)
