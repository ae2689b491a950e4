"""The planner: the best balance, micro-batch count, re-materialization and schedule, by simulation.

For each (schedule, V, M, re-materialization mode) on K devices: the min-max balance whose
stages fit in memory, simulated, kept if every device fits; ranked fastest first. What goes in
(:class:`DeviceSpec`, per-layer costs or measured times) and what is left out:
docs/performance.md#the-planners-search. The command line: ``python recipes/plan_pipeline.py``.

Example::

    layers = measure_layers(model_on_meta, one_sample_on_meta)  # FLOPs and bytes per layer
    device = DeviceSpec(peak_flops=125e12, memory_bytes=16 * 2**30, link_bandwidth=50e9)
    best = plan(layers, num_devices=8, batch_size=512, device=device)[0]   # fastest first
    pipe = GPipe(model, spec=best.spec(devices=[f"cuda:{i}" for i in range(8)]))
    print(format_table([best]))   # predicted samples/s, bubble, peak memory per device
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from giantpipe.engine.microbatch import split_sizes
from giantpipe.engine.recompute import MODES, recompute_stop
from giantpipe.engine.schedules import SCHEDULE_NAMES, VIRTUAL_STAGES, build_schedule
from giantpipe.engine.schedules.actions import Schedule
from giantpipe.engine.spec import PipelineSpec
from giantpipe.perf.balance import NoFit, solve_balance
from giantpipe.perf.costs import LayerCost
from giantpipe.perf.replica_state import ReplicaSharding, keeps_units
from giantpipe.perf.simulate import Simulation, StageCost, peak_activations, simulate

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
    """One configuration, named as a PipelineSpec names it, and what the simulator predicts
    for it."""

    schedule: str
    virtual_stages: int
    chunks: int
    recompute: str  # the re-materialization mode: 'always', 'except_last' or 'never'
    balance: list[int]
    step_time_s: float
    samples_per_s: float
    bubble: float
    peak_memory_bytes: list[int]  # per device
    simulation: Simulation = field(repr=False, compare=False)

    def spec(self, **fixed: Any) -> PipelineSpec:
        """The planner's output as both pipes take it: this candidate's balance, M, V, schedule
        and recompute; ``fixed``: the fields the planner does not choose (devices, timeout,
        deferred_batch_norm, ...).

        Example::

            spec = plan(layers, 2, 64, device)[0].spec(devices=["cuda:0", "cuda:1"])
            pipe = GPipe(model, spec=spec)
        """
        return PipelineSpec.from_keywords(
            balance=self.balance,
            chunks=self.chunks,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            recompute=self.recompute,
            **fixed,
        )


def plan(
    layers: Sequence[LayerCost],
    num_devices: int,
    batch_size: int,
    device: DeviceSpec,
    schedules: Sequence[str] = SCHEDULE_NAMES,
    virtual_stages: Sequence[int] = (2, 4),
    chunks: Sequence[int] | None = None,
    recompute: Sequence[str] = MODES,
    optimizer_slots: int = 1,
    layer_times: LayerTimes | None = None,
    overhead: float = 0.0,
    top: int | None = None,
    progress: Progress | None = None,
    replicas: ReplicaSharding | None = None,
) -> Ranked:
    """Every configuration that fits, fastest first (ties: least peak memory).

    ``chunks`` defaults to the powers of two up to ``batch_size``; ``virtual_stages`` applies
    to 'interleaved' (V = 2 for 'zb-v', 1 elsewhere); ``optimizer_slots`` counts
    per-parameter optimizer state (1: RMSProp or momentum, as the paper's 12 bytes per
    parameter; 2: Adam).
    ``recompute`` lists the re-materialization modes to try.
    ``layer_times`` replaces the device model's seconds by measured ones (memory still comes
    from ``layers``); ``overhead`` is added to every simulated action.

    ``top``: only the ``top`` fastest, exactly ``plan(...)[:top]``, found without simulating
    the rest: every configuration's balance and memory are checked (``.fitting`` counts those
    that fit), but a configuration whose busiest worker alone (a lower bound of the step) takes
    longer than the ``top``-th fastest step found so far cannot rank and is not replayed.
    ``progress(done, total)`` is called as configurations are checked and simulated.
    ``replicas``: R replicas of every stage and their sharding (``pipeline.replica_sharding``):
    what a device holds of its stages' parameters, gradients and optimizer state
    (:mod:`giantpipe.perf.replica_state`); ``batch_size`` is then one replica's share.
    """
    options = chunks or [2**i for i in range(batch_size.bit_length()) if 2**i <= batch_size]
    budget = device.memory_bytes * (1 - device.reserve)
    measured = _Measured(layer_times, overhead) if layer_times is not None else None
    search = _Search(layers, batch_size, device, optimizer_slots, measured, replicas)
    grid = search_space(num_devices, len(layers), schedules, virtual_stages, options, recompute)
    total = 2 * len(grid)  # each configuration is checked, then simulated or ruled out
    tick = progress if progress is not None else (lambda done, total: None)
    fitting: list[tuple[float, int, _Fitted]] = []
    for index, (name, m, v, mode) in enumerate(grid):
        fitted = search.fit(search.schedule(name, num_devices, m, v), mode, budget)
        if fitted is not None:
            fitting.append((fitted.lower_bound(), index, fitted))
        tick(index + 1, total)
    fitting.sort(key=lambda f: (f[0], f[1]))
    found: list[tuple[tuple[float, int], int, Candidate]] = []
    for done, (bound, index, fitted) in enumerate(fitting, len(grid) + 1):
        if top is not None and len(found) >= top and _cannot_rank(bound, found, top):
            break
        candidate = fitted.simulate()
        # sort is stable: equal keys keep the order in which the configurations were tried
        found.append(
            ((-candidate.samples_per_s, max(candidate.peak_memory_bytes)), index, candidate)
        )
        if top is not None:
            found.sort(key=lambda f: (f[0], f[1]))
        tick(done, total)
    tick(total, total)
    found.sort(key=lambda f: (f[0], f[1]))
    ranked = Ranked(c for _, _, c in found[:top])
    ranked.fitting = len(fitting)
    if not fitting:
        ranked.leanest = search.leanest(grid, num_devices)
    return ranked


def _cannot_rank(bound: float, found: list, top: int) -> bool:
    # The simulated step is at least the busiest worker's own work; the margin covers the
    # rounding of summing the same seconds in another order, so ties are always simulated.
    slowest_kept = found[top - 1][2].step_time_s
    return bound * (1 - 1e-9) > slowest_kept


@dataclass(frozen=True)
class Leanest:
    """The configuration that needs the least memory, each with its fastest balance."""

    schedule: str
    virtual_stages: int
    chunks: int
    recompute: str
    peak_bytes: int  # on its fullest device


class Ranked(list[Candidate]):
    """:func:`plan`'s answer: the candidates, fastest first, and ``fitting``, how many
    configurations fit (more than the list holds when ``plan`` was asked for its ``top``);
    when none fits, ``leanest``: the one that comes closest (None: no configuration at all)."""

    fitting: int = 0
    leanest: Leanest | None = None


Progress = Callable[[int, int], None]
"""``progress(done, total)``: configurations simulated so far, out of how many."""


def search_space(
    num_devices: int,
    num_layers: int,
    schedules: Sequence[str],
    virtual_stages: Sequence[int],
    chunks: Sequence[int],
    recompute: Sequence[str],
) -> list[tuple[str, int, int, str]]:
    """Every (schedule, M, V, mode) :func:`plan` simulates, in the order it tries them.

    >>> search_space(2, 8, ["gpipe", "interleaved"], [2], [1, 2], ["never"])
    [('gpipe', 1, 1, 'never'), ('gpipe', 2, 1, 'never'), ('interleaved', 2, 2, 'never')]
    """
    grid = []
    for name, m, mode in itertools.product(schedules, chunks, recompute):
        fixed = (VIRTUAL_STAGES.get(name, 1),)  # zb-v: its V shape needs exactly 2
        for v in virtual_stages if name == "interleaved" else fixed:
            if num_devices * v > num_layers or (name == "interleaved" and m % num_devices):
                continue
            grid.append((name, m, v, mode))
    return grid


class _Search:
    """What every configuration of one search shares, computed once: each schedule (ZB-V's
    list schedule is the costliest part of a configuration; three modes use the same one), its
    memory pressure per mode, and the per-layer costs per micro-batch size."""

    def __init__(
        self,
        layers: Sequence[LayerCost],
        batch_size: int,
        device: DeviceSpec,
        slots: int,
        measured: _Measured | None,
        replicas: ReplicaSharding | None = None,
    ) -> None:
        self.layers, self.batch_size, self.device = layers, batch_size, device
        self.slots, self.measured = slots, measured
        self.replicas = replicas or ReplicaSharding()
        self.largest = max((c.param_bytes for c in layers), default=0)  # full's gathered unit
        self._schedules: dict[tuple[str, int, int, int], Schedule] = {}
        self._pressure: dict[tuple[int, str], list[list[tuple[int, int]]]] = {}
        self._per_layer: dict[tuple[int, bool], list[StageCost]] = {}

    def schedule(self, name: str, k: int, m: int, v: int) -> Schedule:
        key = (name, k, m, v)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(name, k, m, v)
        return self._schedules[key]

    def pressure(self, schedule: Schedule, mode: str) -> list[list[tuple[int, int]]]:
        key = (id(schedule), mode)  # schedules are kept in self._schedules: ids stay unique
        if key not in self._pressure:
            self._pressure[key] = pressure(schedule, mode)
        return self._pressure[key]

    def sharding(self, schedule: Schedule) -> ReplicaSharding:
        """The replicas' sharding under ``schedule`` (full keeps units under zero bubble)."""
        return dataclasses.replace(self.replicas, split=keeps_units(schedule.name))

    def per_layer(self, micro: int, sharding: ReplicaSharding | None = None) -> list[StageCost]:
        sharding = sharding or self.replicas
        key = (micro, sharding.split)
        if key not in self._per_layer:
            device, slots = self.device, self.slots
            costs = [
                _layer_cost(c, micro, device, slots, first=i == 0, replicas=sharding)
                for i, c in enumerate(self.layers)
            ]
            if self.measured is not None:
                costs = self.measured.apply(costs, micro)
            self._per_layer[key] = costs
        return self._per_layer[key]

    def leanest(self, grid: list[tuple[str, int, int, str]], k: int) -> Leanest | None:
        """Of ``grid``'s configurations, with no memory limit, the one whose fullest device
        holds the least at its peak."""
        found = None
        for name, m, v, mode in grid:
            fitted = self.fit(self.schedule(name, k, m, v), mode, math.inf)
            if fitted is None:  # no limit rules nothing out; kept for the type
                continue
            peak = max(fitted.peak_memory())
            if found is None or peak < found.peak_bytes:
                found = Leanest(name, v, m, mode, peak)
        return found

    def fit(self, schedule: Schedule, mode: str, budget: float) -> _Fitted | None:
        """The balance and peak memory of one configuration; None if it does not fit."""
        micro = split_sizes(self.batch_size, schedule.chunks)[0]  # the largest one
        sharding = self.sharding(schedule)
        per_layer, layers = self.per_layer(micro, sharding), self.layers
        recomputed = 0.0 if mode == "never" else 1.0
        times = [c.forward + c.backward + recomputed * c.recompute for c in per_layer]
        memory = _stage_memory(per_layer, layers, micro, self.pressure(schedule, mode))
        # a worker of an interleaved schedule holds V stages: give each its share of the budget
        share = budget / schedule.virtual_stages - sharding.gathered_bytes(self.largest)
        try:
            balance = solve_balance(times, schedule.num_stages, lambda *cut: memory(*cut) <= share)
        except NoFit:
            return None
        bounds = list(itertools.accumulate([0, *balance]))
        costs = [combine(per_layer[a:b], layers[a:b], micro) for a, b in itertools.pairwise(bounds)]
        gathered = sharding.gathered_bytes(self.largest)
        costs = [dataclasses.replace(c, static_bytes=c.static_bytes + gathered) for c in costs]
        overhead = self.measured.overhead if self.measured is not None else 0.0
        fitted = _Fitted(schedule, mode, balance, costs, overhead, self.batch_size)
        if max(fitted.peak_memory()) > budget:
            return None
        return fitted


@dataclass(frozen=True)
class _Fitted:
    """A configuration that fits, before its step is simulated."""

    schedule: Schedule
    mode: str
    balance: list[int]
    costs: list[StageCost]
    overhead: float
    batch_size: int

    def peak_memory(self) -> list[int]:
        """The simulator's peak bytes per device (they do not depend on the timing)."""
        stop = recompute_stop(self.mode, self.schedule.chunks)
        static = [0] * self.schedule.num_workers
        for stage, cost in enumerate(self.costs):
            static[self.schedule.placement[stage]] += cost.static_bytes
        peaks = peak_activations(self.schedule, self.costs, stop)
        return [a + s for a, s in zip(peaks, static)]

    def lower_bound(self) -> float:
        """Seconds the busiest worker works (its actions cannot overlap): no step is shorter."""
        stop = recompute_stop(self.mode, self.schedule.chunks)
        split = {(a.stage, a.microbatch) for w in self.schedule.actions for a in w if a.kind == "W"}
        busy = []
        for worker in self.schedule.actions:
            total = 0.0
            for a in worker:
                c, replay = self.costs[a.stage], a.microbatch < stop
                if a.kind == "F":
                    total += c.forward_no_grad if replay else c.forward
                elif a.kind == "B":
                    total += c.backward_input if (a.stage, a.microbatch) in split else c.backward
                    total += c.recompute if replay and c.recompute > 0 else 0.0
                else:
                    total += c.weight
                total += self.overhead
            busy.append(total)
        return max(busy)

    def simulate(self) -> Candidate:
        sim = simulate(self.schedule, self.costs, self.mode, self.overhead)
        return Candidate(
            self.schedule.name,
            self.schedule.virtual_stages,
            self.schedule.chunks,
            self.mode,
            self.balance,
            sim.step_time,
            sim.samples_per_second(self.batch_size),
            sim.bubble,
            sim.peak_memory_bytes,
            sim,
        )


def _stage_memory(
    per_layer: Sequence[StageCost],
    layers: Sequence[LayerCost],
    micro: int,
    pressures: list[list[tuple[int, int]]],
) -> Callable[[int, int, int], float]:
    """``memory(stage, first, end)``: the bytes stage ``stage`` holds at its worst moment when
    it is made of layers ``first .. end - 1`` (prefix sums: O(1) per cut)."""
    static = list(itertools.accumulate((c.static_bytes for c in per_layer), initial=0))
    saved = list(itertools.accumulate((c.activation_bytes for c in per_layer), initial=0))
    inner = list(itertools.accumulate((c.input_saved * micro for c in layers), initial=0))

    def memory(stage: int, j: int, i: int) -> float:
        act = saved[i] - saved[j] + inner[i] - inner[j + 1]
        held = max(a * per_layer[j].input_bytes + c * act for a, c in pressures[stage])
        return static[i] - static[j] + held

    return memory


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


def _layer_cost(
    c: LayerCost,
    micro: int,
    device: DeviceSpec,
    slots: int,
    first: bool,
    replicas: ReplicaSharding | None = None,
) -> StageCost:
    """One layer for one micro-batch. Backward = input gradient + weight gradient, each about
    the forward's FLOPs; the model's first layer needs no input gradient. Its state (weights,
    gradients, optimizer slots) as ``replicas`` spreads it (default: one replica)."""
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
        static_bytes=int((replicas or ReplicaSharding()).layer_bytes(c.param_bytes, slots)),
    )


def combine(parts: Sequence[StageCost], layers: Sequence[LayerCost], micro: int) -> StageCost:
    """A stage of consecutive layers (:func:`merge_costs`), its inner inputs those that autograd
    saves (``LayerCost.input_saved``) for ``micro`` samples."""
    return merge_costs(parts, sum(layer.input_saved for layer in layers[1:]) * micro)


def merge_costs(parts: Sequence[StageCost], inner_bytes: int) -> StageCost:
    """A stage of consecutive parts (layers, or runs of them): every time and the static bytes
    add up; it receives its first part's input, sends its last part's output, and keeps every
    part's activations plus ``inner_bytes``, what it keeps of the inner parts' inputs.

    >>> a = StageCost(1.0, 2.0, input_bytes=10, activation_bytes=100, send=0.5)
    >>> b = StageCost(3.0, 4.0, input_bytes=20, activation_bytes=200, send=0.25)
    >>> stage = merge_costs([a, b], inner_bytes=20)
    >>> stage.forward, stage.recompute, stage.input_bytes, stage.activation_bytes, stage.send
    (4.0, 4.0, 10, 320, 0.25)
    """
    return StageCost(
        forward=sum(p.forward for p in parts),
        backward=sum(p.backward for p in parts),
        backward_input=sum(p.backward_input for p in parts),
        weight=sum(p.weight for p in parts),
        forward_no_grad=sum(p.forward_no_grad for p in parts),
        recompute=sum(p.recompute for p in parts),
        send=parts[-1].send,
        input_bytes=parts[0].input_bytes,
        activation_bytes=sum(p.activation_bytes for p in parts) + inner_bytes,
        static_bytes=sum(p.static_bytes for p in parts),
    )


def pressure(schedule: Schedule, mode: str) -> list[list[tuple[int, int]]]:
    """Per stage, the (inputs held, activations held) counts at each moment that may be its
    memory peak under ``schedule`` and ``mode``; the peak is the largest a*input + c*act."""
    stop = recompute_stop(mode, schedule.chunks)
    split = {(a.stage, a.microbatch) for w in schedule.actions for a in w if a.kind == "W"}
    counts: list[set[tuple[int, int]]] = [set() for _ in range(schedule.num_stages)]
    for worker in schedule.actions:
        held = {a.stage: (0, 0) for a in worker}
        for a in worker:
            n_in, n_act = held[a.stage]
            recomputed = a.microbatch < stop
            if a.kind == "F":
                held[a.stage] = (n_in + 1, n_act + (0 if recomputed else 1))
            elif a.kind == "B" and recomputed:
                held[a.stage] = (n_in, n_act + 1)
            counts[a.stage].add(held[a.stage])
            if a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split):
                n_in, n_act = held[a.stage]  # frees the input and the (recomputed) activations
                held[a.stage] = (n_in - 1, n_act - 1)
    return [_pareto(c) for c in counts]


def _pareto(points: set[tuple[int, int]]) -> list[tuple[int, int]]:
    return [p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points)]


def format_table(candidates: Sequence[Candidate]) -> str:
    """The candidates as a markdown table, one row each, ranked as given; the peak memory in
    the unit of the largest (a small model's reads in KiB, not as 0.0 GiB).

    Example::

        print(format_table(plan(layers, 8, 512, device)[:10]))
    """
    unit, size = memory_unit(max((b for c in candidates for b in c.peak_memory_bytes), default=0))
    lines = [
        "| # | schedule | V | M | recompute | balance | samples/s | step s | bubble "
        f"| peak {unit} per device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, c in enumerate(candidates, 1):
        peaks = " ".join(f"{b / size:.1f}" for b in c.peak_memory_bytes)
        lines.append(
            f"| {rank} | {c.schedule} | {c.virtual_stages} | {c.chunks} | {c.recompute} "
            f"| {c.balance} | {c.samples_per_s:.1f} | {c.step_time_s:.3f} | {c.bubble:.3f} "
            f"| {peaks} |"
        )
    return "\n".join(lines)


def memory_unit(nbytes: float) -> tuple[str, int]:
    """The binary unit a column of byte counts up to ``nbytes`` reads best in, and its size.

    >>> memory_unit(150_000), memory_unit(12 * 2**30), memory_unit(900)
    (('KiB', 1024), ('GiB', 1073741824), ('B', 1))
    """
    for unit, power in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 2**power:
            return unit, 2**power
    return "B", 1


@contextmanager
def progress_bar(enabled: bool | None = None) -> Iterator[Progress]:
    """A tqdm bar on stderr that :func:`~giantpipe.perf.planner.plan` advances (``progress=``):
    each configuration is checked, then simulated or ruled out by its bound. ``enabled=None``:
    only when stderr is a terminal (logs and CI stay clean).

    Example::

        with progress_bar() as progress:
            best = plan(layers, 8, 512, device, top=10, progress=progress)[0]
    """
    from tqdm import tqdm  # only when a bar is asked for: the planner itself needs none

    with tqdm(desc="planning", unit="config", file=sys.stderr, disable=_off(enabled)) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield advance


def _off(enabled: bool | None) -> bool | None:
    # tqdm's disable=None: off when the stream is not a terminal
    return None if enabled is None else not enabled
