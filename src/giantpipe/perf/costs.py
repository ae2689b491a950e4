"""What each layer of a model costs: FLOPs and bytes per sample, and measured seconds.

:func:`measure_layers` runs one sample layer by layer on the meta device (shapes only) under
torch's FLOP counter and the engine's saved-bytes meter; :class:`LayerTimer` times each layer on
the real device, :class:`DeviceModel` gives seconds from FLOPs and bytes. How, and what uneven
layers look like: docs/performance.md#what-a-layer-costs.

    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> costs = measure_layers(model, torch.empty(1, 8, device="meta"))
    >>> [c.flops for c in costs], [c.params for c in costs]
    ([256.0, 0.0, 128.0], [144, 0, 68])
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from giantpipe.engine.meta import LayerInit
from giantpipe.engine.microbatch import TensorOrTensors, as_tuple, nbytes
from giantpipe.engine.recompute import recomputing
from giantpipe.engine.rng import rng_context
from giantpipe.engine.stats import SavedTensorMeter
from giantpipe.engine.step_config import LossFn
from giantpipe.perf.materialize import has_meta_parameters, layer_on
from giantpipe.perf.simulate import StageCost
from giantpipe.perf.stage_profile import profile_stages


@dataclass(frozen=True)
class LayerCost:
    """One layer, one sample."""

    flops: float  # forward FLOPs (2 per multiply-add of matmuls and convolutions)
    params: int
    param_bytes: int
    input_bytes: int  # the layer's input: what a stage starting here receives and keeps
    saved_bytes: int  # what autograd saves in the forward, beyond the layer's input
    input_saved: int  # bytes of the input that autograd saves too (kept once per stage)
    output_bytes: int  # what crosses the boundary after this layer


@dataclass(frozen=True)
class DeviceModel:
    """Seconds of each layer's actions on one device, from the layer's FLOPs and bytes.

    For a micro-batch of n samples, an action (forward, input gradient, weight gradient) of a
    layer takes::

        flops * n / (peak_flops * efficiency(n))     matmuls and convolutions
      + traffic * n / memory_bandwidth              what the layer reads and writes
      + layer_overhead                               kernel launches, framework bookkeeping

    ``efficiency(n) = efficiency * n / (n + half_batch)``: small micro-batches leave a device
    idle (small kernels, launch-bound), so its share of peak grows with n and saturates;
    ``half_batch = 0`` keeps it constant. The memory term is why BatchNorm, ReLU and pooling
    cost time without FLOPs: their traffic is the layer's input and output plus what autograd
    saves (``saved_bytes``, which holds every intermediate of a cell), read or written once per
    action. The two terms add (a cell's elementwise kernels run between its convolutions, not
    under them). A forward's FLOPs are measured (:func:`measure_layers`); the input gradient and
    the weight gradient each cost as much again (none for the model's first layer's input, none
    for a layer without weights).

    Example::

        >>> layer = LayerCost(flops=2e9, params=10, param_bytes=40, input_bytes=1000,
        ...                   saved_bytes=2000, input_saved=0, output_bytes=1000)
        >>> device = DeviceModel(peak_flops=1e12, memory_bandwidth=1e11, efficiency=0.5)
        >>> [round(t * 1e3, 3) for t in device.layer_times([layer, layer])(4)[1]]  # ms
        [16.0, 16.0, 16.0]
        >>> device.efficiency_at(4), DeviceModel(1e12, 1e11, 0.5, half_batch=4).efficiency_at(4)
        (0.5, 0.25)
    """

    peak_flops: float  # FLOP/s at the training precision
    memory_bandwidth: float  # bytes/s of the device's own memory
    efficiency: float = 0.5  # share of peak reached on large micro-batches
    half_batch: float = 0.0  # micro-batch size at which half of ``efficiency`` is reached
    layer_overhead: float = 0.0  # seconds per layer and action

    def efficiency_at(self, n: int) -> float:
        """The share of peak FLOP/s reached at a micro-batch of ``n`` samples."""
        return self.efficiency * n / (n + self.half_batch)

    def layer_times(
        self, layers: Sequence[LayerCost]
    ) -> Callable[[int], list[tuple[float, float, float]]]:
        """``times(n)``: (forward, input gradient, weight gradient) seconds per layer for a
        micro-batch of ``n``: the ``layer_times`` the planner takes in place of measured ones."""

        def times(n: int) -> list[tuple[float, float, float]]:
            rate = self.peak_flops * self.efficiency_at(n)
            out = []
            for i, c in enumerate(layers):
                compute = c.flops * n / rate
                traffic = (c.input_bytes + c.saved_bytes + c.output_bytes) * n
                action = compute + traffic / self.memory_bandwidth + self.layer_overhead
                weight = compute + c.saved_bytes * n / self.memory_bandwidth
                out.append((action, 0.0 if i == 0 else action, weight if c.params else 0.0))
            return out

        return times


def measure_layers(
    model: nn.Sequential, sample: Any, loss_saves_output: bool = True, count_flops: bool = True
) -> list[LayerCost]:
    """Per-layer costs of ``model`` for one sample (a tensor or tuple; batch size 1).

    Best run with the model and sample on the meta device. With ``loss_saves_output`` the last
    layer also keeps its output, as a cross-entropy loss on logits does (its log-softmax).
    Without ``count_flops`` (bytes only: a third faster) every ``flops`` is 0.
    """
    params = list(model.parameters())
    costs, x = [], sample
    for i, layer in enumerate(model):
        leaves = _leaves(x, first=i == 0)
        meter = _StorageMeter(params, inputs=[t for t in as_tuple(leaves) if torch.is_tensor(t)])
        counter = FlopCounterMode(display=False) if count_flops else None
        with counter or contextlib.nullcontext(), meter:
            y = layer(leaves)
        own = list(layer.parameters())
        saved = meter.bytes
        if loss_saves_output and i == len(model) - 1:
            saved += nbytes(y)
        costs.append(
            LayerCost(
                flops=float(counter.get_total_flops()) if counter is not None else 0.0,
                params=sum(p.numel() for p in own),
                param_bytes=sum(p.numel() * p.element_size() for p in own),
                input_bytes=nbytes(leaves),
                saved_bytes=saved,
                input_saved=meter.input_bytes,
                output_bytes=nbytes(y),
            )
        )
        x = _detach(y)
    return costs


def _key(t: torch.Tensor) -> int:
    # A storage's identity; meta tensors have no data pointer, but their storages are distinct.
    return int(t.untyped_storage()._cdata)


class _StorageMeter(SavedTensorMeter):
    """The engine's saved-bytes meter, its storages keyed by identity rather than data pointer
    (meta tensors have none), the inputs' own storages reported apart (``input_bytes``).

    Only the key differs from :class:`~giantpipe.engine.stats.SavedTensorMeter`; this class
    goes once that meter keys storages by identity itself.
    """

    def __init__(self, exclude: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._exclude = frozenset(_key(p) for p in exclude)
        self._inputs = {_key(t): t.untyped_storage().nbytes() for t in inputs}
        self.input_bytes = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key not in self._exclude and key not in self._seen:
            self._seen.add(key)
            if key in self._inputs:
                self.input_bytes += self._inputs[key]
            else:
                self.bytes += tensor.untyped_storage().nbytes()
        return tensor


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


def meta_copy(model: nn.Sequential) -> nn.Sequential:
    """The model on the meta device (shapes only), copied one layer at a time."""
    return nn.Sequential(*[copy.deepcopy(layer).to("meta") for layer in model]).train()


def meta_sample(inputs: TensorOrTensors, n: int = 1) -> TensorOrTensors:
    """The first ``n`` samples of ``inputs`` on the meta device."""
    if isinstance(inputs, tuple):
        return tuple(torch.empty_like(t[:n], device="meta") for t in inputs)
    return torch.empty_like(inputs[:n], device="meta")


class LayerTimer:
    """Seconds per layer on ``device`` for a micro-batch of n samples: measured at a few sizes
    (:meth:`calibrate`), linear in n between and beyond them. Each layer runs as the executor
    runs a stage (:func:`~giantpipe.perf.stage_profile.profile_stages`), one layer at a time,
    on a copy made real on ``device`` (:func:`~giantpipe.perf.materialize.layer_on`: a model
    built on meta needs ``init``) unless it is real there already: its input is the previous
    layer's output, and only that boundary is kept. The loss runs after the last layer.

    Example::

        timer = LayerTimer(model, "cpu", inputs, targets, loss_fn, threads=1)
        timer.calibrate([8, 64])
        timer(16)   # [(forward_s, input_grad_s, weight_grad_s), ...] per layer
    """

    def __init__(
        self,
        model: nn.Sequential,
        device: str,
        inputs: TensorOrTensors,
        targets: TensorOrTensors,
        loss_fn: LossFn,
        threads: int | None,
        repeats: int = 3,  # the median of 3: one disturbed run does not move it
        init: LayerInit | None = None,
    ) -> None:
        self.model, self.device, self.init = model, torch.device(device), init
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.threads, self.repeats = threads, repeats
        self.points: dict[int, list[StageCost]] = {}

    def calibrate(self, sizes: Sequence[int]) -> None:
        """Every layer's measured cost on the first n samples, for each n of ``sizes``: one
        pass over the layers, each made real once and dropped before the next."""
        sizes = sorted(set(sizes))
        x: dict[int, Any] = {n: _to(_head(self.inputs, n), self.device) for n in sizes}
        found: dict[int, list[StageCost]] = {n: [] for n in sizes}
        for i in range(len(self.model)):
            stage = nn.Sequential(self._layer(i))
            last = i == len(self.model) - 1
            for n in sizes:
                found[n] += self._profile(stage, i, x[n], n, last)
                if not last:
                    with torch.no_grad(), recomputing(stage), rng_context(0, 0, self.device):
                        x[n] = stage(x[n])
            del stage  # before the next layer is made
        self.points.update(found)

    def _layer(self, i: int) -> nn.Module:
        # a real layer on the device runs as it is (a profile leaves its state as it was): a
        # copy would hold it twice
        layer = self.model[i]
        here = all(t.device == self.device for t in [*layer.parameters(), *layer.buffers()])
        return (
            layer
            if here and not has_meta_parameters(layer)
            else layer_on(self.model, i, self.device, self.init)
        )

    def _profile(self, stage: nn.Sequential, i: int, x: Any, n: int, last: bool) -> list[StageCost]:
        return profile_stages(
            [stage],
            [self.device],
            x if i == 0 else _leaves(x, first=False),  # wants its input gradient
            _head(self.targets, n) if last else None,
            self.loss_fn if last else None,
            repeats=self.repeats,
            threads=self.threads,
            names=[f"layer {i} ({type(stage[0]).__name__})"],
        )

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


def _head(tensors: TensorOrTensors, n: int) -> TensorOrTensors:
    return tuple(t[:n] for t in tensors) if isinstance(tensors, tuple) else tensors[:n]


def _to(tensors: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    if isinstance(tensors, tuple):
        return tuple(t.to(device) for t in tensors)
    return tensors.to(device)


def _leaves(x: Any, first: bool) -> Any:
    # Detached copies of the layer's inputs; floats want a gradient unless the layer is first
    def leaf(t: Any) -> Any:
        if not torch.is_tensor(t):
            return t
        return t.detach().requires_grad_(t.is_floating_point() and not first)

    return leaf(x) if torch.is_tensor(x) else tuple(leaf(t) for t in x)


def _detach(y: Any) -> Any:
    return (
        y.detach()
        if torch.is_tensor(y)
        else tuple(t.detach() if torch.is_tensor(t) else t for t in y)
    )
