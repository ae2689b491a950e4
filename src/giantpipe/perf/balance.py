"""Balance: how many consecutive layers each stage gets.

The cut minimises the largest stage cost, exactly (:func:`solve_balance`); the policies
(:func:`balance_by_params`, :func:`balance_by_time`, :func:`balance_by_size`,
:func:`even_balance`) differ only in what a layer's cost is:
docs/performance.md#balance-the-exact-min-max-cut.

    >>> solve_balance([1, 1, 1, 5, 1, 1], partitions=3)
    [3, 1, 2]
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from giantpipe.engine.meta import LayerInit
from giantpipe.engine.microbatch import TensorOrTensors, as_tuple, to_device
from giantpipe.engine.stats import SavedTensorMeter
from giantpipe.perf.materialize import layer_on
from giantpipe.perf.stage_profile import MAX_SPREAD, NEGLIGIBLE, Clock, TimingNoise, spread

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


def even_balance(layers: int, stages: int) -> list[int]:
    """``layers`` in ``stages`` runs as even as possible, the first ones longer.

    >>> even_balance(8, 3)
    [3, 3, 2]
    """
    return [layers // stages + (s < layers % stages) for s in range(stages)]


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


AGREEMENT = 0.8
"""Share of the runs whose own timings must give the medians' cut for :func:`balance_by_time` to
trust it (4 of 5: one disturbed run is the median's to drop)."""

FALLBACKS = ("flops", "params", "time")
"""What :func:`balance_by_time` balances by when the timings are too noisy to trust."""


WINDOW_BYTES = 2**30
"""On a CPU, :func:`time_layers` goes round the layers of a window of consecutive layers whose
parameters take at most this many bytes (one layer at least): only one window's copies are
held at a time, however large the model."""


def time_layers(
    module: nn.Sequential,
    sample: TensorOrTensors,
    device: torch.device,
    repeats: int = 5,
    clock: Clock = time.perf_counter,
    init: LayerInit | None = None,
    window_bytes: int = WINDOW_BYTES,
) -> list[list[float]]:
    """``repeats`` timings (seconds) of forward + backward of each layer, the sample flowing
    layer to layer; each after a warm-up run. The backward is inside the timed window: a layer
    may cost little forward and much backward.

    Each layer is profiled on a copy made real on ``device``
    (:func:`~giantpipe.perf.materialize.layer_on`; ``init`` fills a model built on meta), so
    parameters, gradients and BatchNorm statistics of ``module`` are left untouched. On a CPU
    the repeats go round the layers of a window (:data:`WINDOW_BYTES`: layer 0, 1, ..., then
    again), so a burst of load from elsewhere lands on one run of many layers, which the median
    drops, not on every run of one layer; on a GPU only one layer's copy at a time occupies
    ``device``, its runs back to back.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1 (got {repeats})")
    device = torch.device(device)
    x = to_device(sample, device)
    samples: list[list[float]] = []
    with _rng_untouched(device):
        for window in _windows(module, window_bytes if device.type == "cpu" else 0):
            kept: list[tuple[nn.Module, TensorOrTensors]] = []
            for index in window:
                probe = layer_on(module, index, device, init)
                with _naming(index, module[index]):
                    y = _timed(probe, x, device, clock)[0]  # the warm-up: caches, kernels
                if device.type == "cpu":
                    kept.append((probe, x))
                else:
                    samples.append([_timed(probe, x, device, clock)[1] for _ in range(repeats)])
                del probe
                x = y
            if kept:
                rounds = [[_timed(p, i, device, clock)[1] for p, i in kept] for _ in range(repeats)]
                samples += [list(runs) for runs in zip(*rounds)]
    return samples


def _windows(module: nn.Sequential, limit: int) -> list[list[int]]:
    # consecutive layers whose parameters fit ``limit`` bytes together, one layer at least
    windows: list[list[int]] = [[]]
    held = 0
    for index, layer in enumerate(module):
        size = sum(p.numel() * p.element_size() for p in layer.parameters())
        if windows[-1] and held + size > limit:
            windows.append([])
            held = 0
        windows[-1].append(index)
        held += size
    return windows


def _timed(
    layer: nn.Module, x: TensorOrTensors, device: torch.device, clock: Clock
) -> tuple[TensorOrTensors, float]:
    start = clock()
    y = _forward_backward(layer, x)
    _sync(device)
    return y, clock() - start


def profile_times(
    module: nn.Sequential,
    sample: TensorOrTensors,
    device: torch.device,
    repeats: int = 5,
    clock: Clock = time.perf_counter,
) -> list[float]:
    """Median seconds of forward + backward for each layer (:func:`time_layers`)."""
    return [statistics.median(runs) for runs in time_layers(module, sample, device, repeats, clock)]


def untrusted_layers(
    samples: Sequence[Sequence[float]],
    max_spread: float = MAX_SPREAD,
    negligible: float = NEGLIGIBLE,
) -> list[int]:
    """Layers whose repeated timings spread more than ``max_spread`` (:func:`spread`), among
    those that take at least ``negligible`` of the total median time.

    >>> untrusted_layers([[1.0, 1.0, 1.1], [1.0, 4.0, 2.0], [1e-5, 1e-3, 1e-4]])
    [1]
    """
    medians = [statistics.median(runs) if runs else 0.0 for runs in samples]
    total = sum(medians)
    return [
        i
        for i, (runs, median) in enumerate(zip(samples, medians))
        if median >= negligible * total and spread(runs) > max_spread
    ]


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
    repeats: int = 5,
    max_spread: float = MAX_SPREAD,
    fallback: str = "flops",
    clock: Clock = time.perf_counter,
    init: LayerInit | None = None,
) -> list[int]:
    """Balances by measured forward + backward time of each layer on ``sample``: the median of
    ``repeats`` timings per layer, each layer made real on ``device`` one at a time (a model
    built on meta: ``init`` fills each copy, :func:`time_layers`).

    ``sample`` should be one micro-batch, the size each stage really processes. When a layer's
    timings spread more than ``max_spread`` (:func:`untrusted_layers`), or the runs' own
    timings give the medians' cut in fewer than :data:`AGREEMENT` of them (:func:`agreement`:
    a near tie on a busy machine), a :class:`TimingNoise` warning names the layers and the
    balance follows ``fallback``:
    ``"flops"`` (forward FLOPs per layer, counted on the meta device; parameters where that
    fails), ``"params"`` (:func:`balance_by_params`) or ``"time"`` (the medians all the same).

    Example::

        balance = balance_by_time(4, model, x[:8])   # e.g. [5, 6, 6, 7]
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS} (got {fallback!r})")
    samples = time_layers(module, sample, torch.device(device), repeats, clock, init)
    noisy = untrusted_layers(samples, max_spread)
    balance = solve_balance([statistics.median(runs) for runs in samples], partitions)
    agree = agreement(samples, partitions, balance)
    if not noisy and agree >= AGREEMENT:
        return balance
    used = "time"
    if fallback != "time":
        costs, used = _fallback_costs(module, sample, fallback)
        balance = solve_balance(costs, partitions)
    message = _noise_message(module, samples, noisy, max_spread, used, agree)
    warnings.warn(message, TimingNoise, stacklevel=2)
    return balance


def agreement(samples: Sequence[Sequence[float]], partitions: int, balance: list[int]) -> float:
    """The share of runs whose own timings (run r of every layer) give ``balance``: a cut that
    rests on a near tie between two cuts moves from run to run on a busy machine.

    >>> agreement([[1.0, 3.0], [2.0, 2.0], [2.0, 2.0]], 2, [2, 1])  # run 1: [1, 2]
    0.5
    """
    runs = [
        solve_balance([layer[r] for layer in samples], partitions) for r in range(len(samples[0]))
    ]
    return sum(b == balance for b in runs) / len(runs)


def _fallback_costs(
    module: nn.Sequential, sample: TensorOrTensors, fallback: str
) -> tuple[list[float], str]:
    if fallback == "flops":
        from giantpipe.perf.costs import measure_layers, meta_copy, meta_sample  # cycle-free

        try:
            with _rng_untouched(torch.device("cpu")):
                layers = measure_layers(meta_copy(module), meta_sample(sample, _batch(sample)))
            return [c.flops for c in layers], "flops"
        except (RuntimeError, NotImplementedError, TypeError):
            pass  # an op without a meta kernel: parameters are always countable
    return [float(sum(p.numel() for p in layer.parameters())) for layer in module], "params"


def _batch(sample: TensorOrTensors) -> int:
    return int(as_tuple(sample)[0].shape[0])


def _noise_message(
    module: nn.Sequential,
    samples: Sequence[Sequence[float]],
    noisy: Sequence[int],
    max_spread: float,
    used: str,
    agree: float,
) -> str:
    def named(layers: Sequence[int]) -> str:
        shown = [f"{i} ({type(module[i]).__name__}, {spread(samples[i]):.0%})" for i in layers]
        return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")

    problems = []
    if noisy:
        problems.append(
            f"the timings of layer {named(noisy)} spread more than max_spread={max_spread:.0%} "
            f"(interquartile range over median of {len(samples[0])} runs)"
        )
    if agree < AGREEMENT:
        widest = sorted(range(len(samples)), key=lambda i: -spread(samples[i]))[:3]
        problems.append(
            f"the cut moves from run to run (each run's timings alone give the medians' cut in "
            f"{agree:.0%} of them; widest spread: layer {named(widest)})"
        )
    instead = {
        "flops": "balancing by forward FLOPs instead",
        "params": "balancing by parameter count instead",
        "time": "balancing by the medians anyway (fallback='time')",
    }[used]
    return (
        f"balance_by_time: {'; '.join(problems)}; the machine is busy: {instead}; time on a "
        "quieter machine, raise repeats, or give the balance"
    )


def profile_sizes(
    module: nn.Sequential,
    sample: TensorOrTensors,
    param_scale: float,
    device: torch.device,
    init: LayerInit | None = None,
) -> list[float]:
    """Bytes per layer: parameter bytes x ``param_scale`` + activation bytes saved for backward,
    each layer run on a copy made real on ``device``, one at a time (``init``: see
    :func:`time_layers`)."""
    device = torch.device(device)
    x = to_device(sample, device)
    sizes = []
    with _rng_untouched(device):
        for index in range(len(module)):
            probe = layer_on(module, index, device, init)
            meter = SavedTensorMeter(exclude=probe.parameters())
            with meter:
                y = _forward(probe, x)
            param_bytes = sum(p.numel() * p.element_size() for p in probe.parameters())
            sizes.append(param_bytes * param_scale + meter.bytes)
            x = _detach(y)
            del probe, y  # the copy and its graph, before the next layer is made
    return sizes


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    sample: TensorOrTensors,
    param_scale: float = 2.0,
    device: torch.device | str = "cpu",
    init: LayerInit | None = None,
) -> list[int]:
    """Balances by memory: parameters x ``param_scale`` + measured activation bytes.

    ``param_scale`` counts the copies each parameter costs: 2 for weight + gradient (SGD
    without momentum), 3 with momentum or RMSProp, 4 for Adam. ``sample`` is one micro-batch.
    A model built on meta: ``init`` fills each layer's copy (:func:`time_layers`).
    """
    sizes = profile_sizes(module, sample, param_scale, torch.device(device), init)
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
