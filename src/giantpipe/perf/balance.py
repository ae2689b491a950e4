"""Balance: how many consecutive layers each stage gets.

A pipeline runs at the pace of its slowest stage, so the cut should minimise the largest stage
cost. For contiguous stages that problem has an exact, cheap solution (:func:`solve_balance`);
the policies below only differ in what a layer's cost is:

- :func:`balance_by_params`: parameter count (no sample needed);
- :func:`balance_by_time`: measured forward + backward time of each layer on a sample batch;
- :func:`balance_by_size`: parameter bytes x ``param_scale`` (weights, grads, optimizer slots)
  plus the activation bytes each layer really saves for backward on the sample.

Example::

    >>> solve_balance([1, 1, 1, 5, 1, 1], partitions=3)
    [3, 1, 2]
"""

from __future__ import annotations

import bisect
import copy
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from giantpipe.engine.microbatch import TensorOrTensors, as_tuple, to_device
from giantpipe.engine.stats import SavedTensorMeter

Fits = Callable[[int, int, int], bool]
"""``fits(stage, first, end)``: whether layers ``first .. end - 1`` may form stage ``stage``
(e.g. fit in that device's memory)."""


class NoFit(ValueError):
    """No contiguous cut keeps every stage within ``fits``."""


def solve_balance(costs: Sequence[float], partitions: int, fits: Fits | None = None) -> list[int]:
    """Exact contiguous min-max partition of ``costs`` into ``partitions`` non-empty stages.

    Dynamic programming over prefix sums: ``best[k][i]`` is the smallest possible largest stage
    cost when the first ``i`` layers form ``k + 1`` stages, and ``cut[k][i]`` where its last
    stage starts. Ties go to the earliest cut. ``best[k-1][j]`` grows with ``j`` while the last
    stage's cost ``S[i] - S[j]`` shrinks, so the optimal split is where they cross, found by
    bisection: O(K L log L), fast enough for thousands of layers. With ``fits`` (the planner's
    memory limit per stage) a stage may be ruled out anywhere, so every split is tried:
    O(K L^2). Raises :class:`NoFit` when no cut fits.

    >>> solve_balance([1, 1, 1, 5, 1, 1], partitions=3)
    [3, 1, 2]
    >>> solve_balance([1, 1, 1, 5, 1, 1], 3, fits=lambda stage, first, end: end - first <= 2)
    [2, 2, 2]
    """
    n = len(costs)
    if partitions < 1:
        raise ValueError(f"partitions must be positive (got {partitions})")
    if partitions > n:
        raise ValueError(f"cannot cut {n} layers into {partitions} non-empty partitions")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be non-negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    # stage k (0-based) ends at i in [k + 1, n - (partitions - 1 - k)]: later stages need a layer
    first = [math.inf] * (n + 1)
    for i in range(1, n - partitions + 2):
        if fits is None or fits(0, 0, i):
            first[i] = prefix[i]
    best, cuts = [first], [[0] * (n + 1)]
    for k in range(1, partitions):
        row, cut = [math.inf] * (n + 1), [0] * (n + 1)
        for i in range(k + 1, n - partitions + k + 2):
            splits = _splits(best[k - 1], prefix, k, i) if fits is None else range(k, i)
            row[i], cut[i] = _best_split(best[k - 1], prefix, splits, i, _stage_fits(fits, k))
        best.append(row)
        cuts.append(cut)
    if math.isinf(best[-1][n]):
        raise NoFit(f"no cut of {n} layers into {partitions} stages fits")
    return _recover(cuts, n, partitions)


def _splits(prev: list[float], prefix: list[float], k: int, i: int) -> Sequence[int]:
    # The last stage starts at j in [k, i - 1]. The first j where the earlier stages cost at
    # least the last stage, and the one before it: the optimum is one of the two.
    keys = range(k, i)
    pos = bisect.bisect_left(keys, True, key=lambda j: prev[j] >= prefix[i] - prefix[j])
    return [keys[p] for p in (pos - 1, pos) if 0 <= p < len(keys)]


def _best_split(
    prev: list[float],
    prefix: list[float],
    splits: Iterable[int],
    i: int,
    fits: Callable[[int, int], bool],
) -> tuple[float, int]:
    # The earliest of the cheapest splits; ``fits`` is asked only of an improvement (it may be
    # costly: the planner's sums the memory a stage holds at its worst moment)
    best, cut = math.inf, 0
    for j in splits:
        t = max(prev[j], prefix[i] - prefix[j])
        if t < best and fits(j, i):
            best, cut = t, j
    return best, cut


def _stage_fits(fits: Fits | None, stage: int) -> Callable[[int, int], bool]:
    return (lambda first, end: True) if fits is None else partial(fits, stage)


def _recover(cuts: list[list[int]], n: int, partitions: int) -> list[int]:
    bounds, i = [n], n
    for k in range(partitions - 1, 0, -1):
        i = cuts[k][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return [bounds[s + 1] - bounds[s] for s in range(partitions)]


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Total cost of each stage under ``balance``.

    >>> stage_costs([1, 2, 3, 4], [2, 2])
    [3.0, 7.0]
    """
    out, start = [], 0
    for count in balance:
        out.append(float(sum(costs[start : start + count])))
        start += count
    return out


def balance_by_params(partitions: int, module: nn.Sequential) -> list[int]:
    """Balances by parameter count per layer.

    >>> balance_by_params(2, nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10)))
    [1, 2]
    """
    costs = [sum(p.numel() for p in layer.parameters()) for layer in module]
    return solve_balance(costs, partitions)


@contextmanager
def _rng_untouched(device: torch.device) -> Iterator[None]:
    # Profiling runs dropout and drop-path layers, which draw from the global generators. The
    # engine draws each step's seed from them too, so without this a run balanced by time or
    # size would train differently from the same run given the resulting balance by hand.
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def profile_times(
    module: nn.Sequential, sample: TensorOrTensors, device: torch.device, repeats: int = 3
) -> list[float]:
    """Median seconds of forward + backward for each layer, the sample flowing layer to layer.

    Each layer is profiled on a copy, so parameters, gradients and BatchNorm statistics of
    ``module`` are left untouched, and only one layer at a time occupies ``device``.
    """
    device = torch.device(device)
    x = to_device(sample, device)
    times = []
    with _rng_untouched(device):
        for index, layer in enumerate(module):
            probe = copy.deepcopy(layer).to(device)
            samples = []
            for _ in range(repeats + 1):  # the first run warms up caches and kernels
                start = time.perf_counter()
                with _naming(index, layer):
                    y = _forward_backward(probe, x)
                _sync(device)
                samples.append(time.perf_counter() - start)
            times.append(statistics.median(samples[1:]))
            x = y
    return times


@contextmanager
def _naming(index: int, layer: nn.Module) -> Iterator[None]:
    """A layer that fails on its own input (a leaf that requires grad) is named in the note."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"giantpipe: while profiling layer {index} ({type(layer).__name__}) alone")
        raise


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: TensorOrTensors,
    device: torch.device | str = "cpu",
    repeats: int = 3,
) -> list[int]:
    """Balances by measured forward + backward time of each layer on ``sample``.

    ``sample`` should be one micro-batch, the size each stage really processes.
    """
    return solve_balance(profile_times(module, sample, torch.device(device), repeats), partitions)


def profile_sizes(
    module: nn.Sequential,
    sample: TensorOrTensors,
    param_scale: float,
    device: torch.device,
) -> list[float]:
    """Bytes per layer: parameter bytes x ``param_scale`` + activation bytes saved for backward."""
    device = torch.device(device)
    x = to_device(sample, device)
    sizes = []
    with _rng_untouched(device):
        for layer in module:
            probe = copy.deepcopy(layer).to(device)
            meter = SavedTensorMeter(exclude=probe.parameters())
            with meter:
                y = _forward(probe, x)
            param_bytes = sum(p.numel() * p.element_size() for p in probe.parameters())
            sizes.append(param_bytes * param_scale + meter.bytes)
            x = _detach(y)
    return sizes


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    sample: TensorOrTensors,
    param_scale: float = 2.0,
    device: torch.device | str = "cpu",
) -> list[int]:
    """Balances by memory: parameters x ``param_scale`` + measured activation bytes.

    ``param_scale`` counts the copies each parameter costs: 2 for weight + gradient (SGD
    without momentum), 3 with momentum or RMSProp, 4 for Adam. ``sample`` is one micro-batch.
    """
    sizes = profile_sizes(module, sample, param_scale, torch.device(device))
    return solve_balance(sizes, partitions)


def _forward(layer: nn.Module, x: TensorOrTensors) -> TensorOrTensors:
    inputs = tuple(
        t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
        for t in as_tuple(x)
    )
    return layer(inputs[0] if isinstance(x, torch.Tensor) else inputs)


def _forward_backward(layer: nn.Module, x: TensorOrTensors) -> TensorOrTensors:
    y = _forward(layer, x)
    outs = [t for t in as_tuple(y) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return _detach(y)


def _detach(y: TensorOrTensors) -> TensorOrTensors:
    if isinstance(y, torch.Tensor):
        return y.detach()
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in y)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
