"""The planner's search: every schedule, M and re-materialization mode, a balance for each,
judged by the simulator on a FLOP-and-byte model of the device.

For each (schedule, V, M, checkpoint):

1. balance: the contiguous cut into K*V stages that minimises the slowest stage's time while
   every stage fits in memory (exact dynamic programme over cut points). A stage's memory is
   its parameters x (2 + optimizer slots) plus, at the worst moment of the schedule, n_in
   micro-batches' stage inputs and n_act micro-batches' activations, (n_in, n_act) read off
   the schedule itself (:func:`pressure`): GPipe holds M, 1F1B K-s, re-materialization only
   inputs plus the one being recomputed;
2. simulate: step time, bubble and exact peak memory per device;
3. keep it if every device fits in ``memory_bytes x (1 - reserve)``.

Layer times come from the device model, or, given ``layer_times``, from measurements on the
real device (what ``pipeline.plan=auto`` in the runner passes); ``overhead`` adds the
executor's measured cost to every action. Candidates come back fastest first. Example::

    layers = measure_layers(meta_model, meta_sample)
    device = DeviceSpec(peak_flops=125e12, memory_bytes=16 * 2**30, link_bandwidth=50e9)
    best = plan(layers, num_devices=8, batch_size=256, device=device)[0]
    best.schedule, best.chunks, best.checkpoint, best.balance, best.samples_per_s
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from giantpipe.engine.microbatch import split_sizes
from giantpipe.engine.recompute import MODES, recompute_stop
from giantpipe.engine.schedule import Schedule
from giantpipe.engine.schedules import SCHEDULE_NAMES, build_schedule
from giantpipe.perf.simulate import Simulation, StageCost, simulate
from giantpipe.plan.costs import LayerCost

LayerTimes = Callable[[int], Sequence[tuple[float, float, float]]]
"""Measured seconds per layer for a micro-batch of n samples: (forward, input gradient,
weight gradient), one triple per layer."""


@dataclass(frozen=True)
class DeviceSpec:
    """A device as the FLOP-and-byte model sees it."""

    peak_flops: float  # FLOP/s at the training precision
    memory_bytes: float  # per device
    link_bandwidth: float  # bytes/s to the neighbouring device
    link_latency: float = 10e-6  # seconds per message
    efficiency: float = 0.5  # share of peak reached on large layers
    layer_overhead: float = 100e-6  # seconds per layer and action: launches, small-batch loss
    reserve: float = 0.1  # share of memory left for workspace and fragmentation

    def seconds(self, flops: float, layers: int) -> float:
        return flops / (self.peak_flops * self.efficiency) + layers * self.layer_overhead


@dataclass(frozen=True)
class Candidate:
    """One configuration and what the simulator predicts for it."""

    schedule: str
    virtual_stages: int
    chunks: int
    checkpoint: str
    balance: list[int]
    step_time_s: float
    samples_per_s: float
    bubble: float
    peak_memory_bytes: list[int]  # per device
    simulation: Simulation = field(repr=False, compare=False)


def plan(
    layers: Sequence[LayerCost],
    num_devices: int,
    batch_size: int,
    device: DeviceSpec,
    schedules: Sequence[str] = SCHEDULE_NAMES,
    virtual_stages: Sequence[int] = (2, 4),
    chunks: Sequence[int] | None = None,
    checkpoints: Sequence[str] = MODES,
    optimizer_slots: int = 1,
    layer_times: LayerTimes | None = None,
    overhead: float = 0.0,
) -> list[Candidate]:
    """Every configuration that fits, fastest first (ties: least peak memory).

    ``chunks`` defaults to the powers of two up to ``batch_size``; ``virtual_stages`` applies
    to 'interleaved' (V = 1 elsewhere); ``optimizer_slots`` counts per-parameter optimizer
    state (1: RMSProp or momentum, as the paper's 12 bytes per parameter; 2: Adam).
    ``layer_times`` replaces the device model's seconds by measured ones (memory still comes
    from ``layers``); ``overhead`` is added to every simulated action.
    """
    options = chunks or [2**i for i in range(batch_size.bit_length()) if 2**i <= batch_size]
    budget = device.memory_bytes * (1 - device.reserve)
    found = []
    measured = _Measured(layer_times, overhead) if layer_times is not None else None
    for name, m, mode in itertools.product(schedules, options, checkpoints):
        for v in virtual_stages if name == "interleaved" else (1,):
            if num_devices * v > len(layers) or (name == "interleaved" and m % num_devices):
                continue
            schedule = build_schedule(name, num_devices, m, v)
            candidate = _evaluate(
                layers, schedule, batch_size, device, mode, budget, optimizer_slots, measured
            )
            if candidate is not None:
                found.append(candidate)
    found.sort(key=lambda c: (-c.samples_per_s, max(c.peak_memory_bytes)))
    return found


def _evaluate(
    layers: Sequence[LayerCost],
    schedule: Schedule,
    batch_size: int,
    device: DeviceSpec,
    mode: str,
    budget: float,
    slots: int,
    measured: _Measured | None = None,
) -> Candidate | None:
    micro = split_sizes(batch_size, schedule.num_microbatches)[0]  # the largest one
    per_layer = [_layer_cost(c, micro, device, slots, first=i == 0) for i, c in enumerate(layers)]
    if measured is not None:
        per_layer = measured.apply(per_layer, micro)
    replayed = 0.0 if mode == "never" else 1.0
    times = [c.forward + c.backward + replayed * c.recompute for c in per_layer]
    static = list(itertools.accumulate((c.static_bytes for c in per_layer), initial=0))
    saved = list(itertools.accumulate((c.activation_bytes for c in per_layer), initial=0))
    inner = list(itertools.accumulate((c.input_saved * micro for c in layers), initial=0))
    pressures = pressure(schedule, mode)

    def memory(stage: int, j: int, i: int) -> float:
        act = saved[i] - saved[j] + inner[i] - inner[j + 1]
        held = max(a * per_layer[j].input_bytes + c * act for a, c in pressures[stage])
        return static[i] - static[j] + held

    # a worker of an interleaved schedule holds V stages: give each its share of the budget
    share = budget / schedule.virtual_stages
    balance = min_max_balance(times, schedule.num_stages, memory, share)
    if balance is None:
        return None
    bounds = list(itertools.accumulate([0, *balance]))
    costs = [combine(per_layer[a:b], layers[a:b], micro) for a, b in itertools.pairwise(bounds)]
    sim = simulate(schedule, costs, mode, measured.overhead if measured is not None else 0.0)
    if max(sim.peak_memory_bytes) > budget:
        return None
    return Candidate(
        schedule.name,
        schedule.virtual_stages,
        schedule.num_microbatches,
        mode,
        balance,
        sim.step_time,
        sim.samples_per_second(batch_size),
        sim.bubble,
        sim.peak_memory_bytes,
        sim,
    )


class _Measured:
    """Measured layer times, per micro-batch size asked for once (every schedule and mode
    plans with the same sizes)."""

    def __init__(self, layer_times: LayerTimes, overhead: float) -> None:
        self._layer_times, self.overhead = layer_times, overhead
        self._cache: dict[int, Sequence[tuple[float, float, float]]] = {}

    def apply(self, per_layer: list[StageCost], micro: int) -> list[StageCost]:
        if micro not in self._cache:
            self._cache[micro] = self._layer_times(micro)
        return [
            dataclasses.replace(
                c,
                forward=f,
                backward=b + w,
                backward_input=b,
                weight=w,
                forward_no_grad=f,
                recompute=f,
            )
            for c, (f, b, w) in zip(per_layer, self._cache[micro], strict=True)
        ]


def _layer_cost(c: LayerCost, micro: int, device: DeviceSpec, slots: int, first: bool) -> StageCost:
    """One layer for one micro-batch. Backward = input gradient + weight gradient, each about
    the forward's FLOPs; the model's first layer needs no input gradient."""
    flops = c.flops * micro
    forward = device.seconds(flops, 1)
    backward_input = 0.0 if first else device.seconds(flops, 1)
    weight = device.seconds(flops, 1) if c.params else 0.0
    send = c.output_bytes * micro / device.link_bandwidth + device.link_latency
    return StageCost(
        forward=forward,
        backward=backward_input + weight,
        backward_input=backward_input,
        weight=weight,
        send=send,
        input_bytes=c.input_bytes * micro,
        activation_bytes=c.saved_bytes * micro,
        static_bytes=c.param_bytes * (2 + slots),
    )


def combine(parts: Sequence[StageCost], layers: Sequence[LayerCost], micro: int) -> StageCost:
    """A stage of consecutive layers: times and parameters add up; it keeps its first layer's
    input, every layer's saved bytes, and the inner inputs that autograd saves."""
    inner = sum(layer.input_saved for layer in layers[1:]) * micro
    return StageCost(
        forward=sum(p.forward for p in parts),
        backward=sum(p.backward for p in parts),
        backward_input=sum(p.backward_input for p in parts),
        weight=sum(p.weight for p in parts),
        send=parts[-1].send,
        input_bytes=parts[0].input_bytes,
        activation_bytes=sum(p.activation_bytes for p in parts) + inner,
        static_bytes=sum(p.static_bytes for p in parts),
    )


def pressure(schedule: Schedule, mode: str) -> list[list[tuple[int, int]]]:
    """Per stage, the (inputs held, activations held) counts at each moment that may be its
    memory peak under ``schedule`` and ``mode``; the peak is the largest a*input + c*act."""
    stop = recompute_stop(mode, schedule.num_microbatches)
    split = {(a.stage, a.microbatch) for w in schedule.actions for a in w if a.kind == "W"}
    counts: list[set[tuple[int, int]]] = [set() for _ in range(schedule.num_stages)]
    for worker in schedule.actions:
        held = {a.stage: (0, 0) for a in worker}
        for a in worker:
            n_in, n_act = held[a.stage]
            replay = a.microbatch < stop
            if a.kind == "F":
                held[a.stage] = (n_in + 1, n_act + (0 if replay else 1))
            elif a.kind == "B" and replay:
                held[a.stage] = (n_in, n_act + 1)
            counts[a.stage].add(held[a.stage])
            if a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split):
                n_in, n_act = held[a.stage]  # frees the input and the (recomputed) activations
                held[a.stage] = (n_in - 1, n_act - 1)
    return [_pareto(c) for c in counts]


def _pareto(points: set[tuple[int, int]]) -> list[tuple[int, int]]:
    return [p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points)]


def min_max_balance(
    times: Sequence[float],
    num_stages: int,
    memory: Callable[[int, int, int], float],
    budget: float,
) -> list[int] | None:
    """Contiguous cut of the layers into ``num_stages`` stages minimising the slowest stage,
    with ``memory(stage, first, end) <= budget`` for each; None if no cut fits.

    Dynamic programme: best[s][i] is the best bottleneck for the first i layers in s stages.
    """
    n = len(times)
    prefix = list(itertools.accumulate(times, initial=0.0))
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                t = max(best[s - 1][j], prefix[i] - prefix[j])
                if t < best[s][i] and memory(s - 1, j, i) <= budget:
                    best[s][i], cut[s][i] = t, j
    if math.isinf(best[num_stages][n]):
        return None
    bounds, i = [n], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.reverse()
    return [b - a for a, b in itertools.pairwise(bounds)]
