"""The pipeline simulator: any schedule, run against a cost per action instead of a model.

It replays a schedule as the executor runs it and reports the step time, the bubble and each
worker's peak memory; costs come from a profile of the real model (:mod:`.predict`) or a
device model (the planner). The rules: docs/performance.md#the-simulators-rules.

Example (equal costs: GPipe's bubble is exactly (K-1)/(M+K-1))::

    >>> costs = [StageCost(forward=1.0, backward=2.0)] * 4
    >>> sim = simulate(fill_drain(4, 8), costs)
    >>> sim.step_time, round(sim.bubble, 4)
    (33.0, 0.2727)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from giantpipe.engine.recompute import recompute_stop
from giantpipe.engine.schedules.actions import Action, Schedule, dependencies
from giantpipe.engine.schedules.fill_drain import fill_drain

# fill_drain: for the examples
__all__ = ["Simulation", "StageCost", "TimedAction", "fill_drain", "peak_activations", "simulate"]


@dataclass(frozen=True)
class StageCost:
    """Seconds and bytes of one stage for one micro-batch.

    ``backward`` is the whole backward (input and weight gradients). ``backward_input`` and
    ``weight`` are its two halves where a schedule splits it (default: half each);
    ``forward_no_grad`` (a forward whose activations are not kept) and ``recompute`` default to
    ``forward``. ``send`` is the time to hand this stage's output to the next stage, and its
    gradient back, when the two stages are on different workers.
    """

    forward: float
    backward: float
    backward_input: float = math.nan
    weight: float = math.nan
    forward_no_grad: float = math.nan
    recompute: float = math.nan
    send: float = 0.0
    input_bytes: int = 0
    activation_bytes: int = 0
    static_bytes: int = 0

    def __post_init__(self) -> None:
        defaults = {
            "backward_input": self.backward / 2,
            "weight": self.backward / 2,
            "forward_no_grad": self.forward,
            "recompute": self.forward,
        }
        for name, value in defaults.items():
            if math.isnan(getattr(self, name)):
                object.__setattr__(self, name, value)


@dataclass(frozen=True)
class TimedAction:
    """One action on the simulated timeline; ``recompute`` seconds run first, from ``start``,
    and the rest of the work ends at ``end`` (any gap between is waiting for a neighbour)."""

    action: Action
    worker: int
    start: float
    end: float
    busy: float
    recompute: float = 0.0


@dataclass(frozen=True)
class Simulation:
    """What a schedule costs: per-worker figures are indexed by worker (device)."""

    schedule: Schedule
    step_time: float  # first action's start to last action's end
    busy: list[float]  # seconds each worker spends running actions
    bubble: float  # idle share of the K timelines: 1 - sum(busy) / (K * step_time)
    peak_activation_bytes: list[int]
    peak_memory_bytes: list[int]  # activations + static (parameters, gradients, optimizer)
    timeline: list[TimedAction] = field(repr=False)

    def samples_per_second(self, batch_size: int) -> float:
        """Throughput of a mini-batch of ``batch_size`` samples per step."""
        return batch_size / self.step_time if self.step_time > 0 else math.inf


def simulate(
    schedule: Schedule,
    costs: Sequence[StageCost],
    recompute: str = "never",
    overhead: float = 0.0,
    contention: float = 1.0,
) -> Simulation:
    """Runs ``schedule`` against ``costs`` (one per stage) under a re-materialization mode.

    ``overhead`` seconds are added to every action (the executor's hand-over and bookkeeping).
    ``contention``: how much slower an action runs while all K workers run at once than
    alone (CPU stand-ins share cores and memory bandwidth; 1 for separate devices); with n
    running, the slowdown is interpolated linearly, 1 + (contention - 1)(n - 1)/(K - 1).
    """
    if len(costs) != schedule.num_stages:
        raise ValueError(f"{len(costs)} stage costs for {schedule.num_stages} stages")
    stop = recompute_stop(recompute, schedule.chunks)
    timeline = _timeline(schedule, costs, stop, overhead, contention)
    span = max(t.end for t in timeline) - min(t.start for t in timeline)
    busy = [0.0] * schedule.num_workers
    for t in timeline:
        busy[t.worker] += t.busy
    k = schedule.num_workers
    bubble = max(0.0, 1.0 - sum(busy) / (k * span)) if span > 0 else 0.0
    activations = peak_activations(schedule, costs, stop)
    static = [0] * k
    for stage, cost in enumerate(costs):
        static[schedule.placement[stage]] += cost.static_bytes
    peaks = [a + s for a, s in zip(activations, static)]
    return Simulation(schedule, span, busy, bubble, activations, peaks, timeline)


def _timeline(
    schedule: Schedule, costs: Sequence[StageCost], stop: int, overhead: float, contention: float
) -> list[TimedAction]:
    return _Replay(schedule, costs, stop, overhead, contention).run()


class _Replay:
    """Event-driven replay. Each worker is idle, replaying a forward ("pre", the opening of a
    re-materialized B, which needs no gradient) or working; running actions advance at
    1/slowdown(number running), so workers sharing cores and memory slow each other down only
    while they really run at the same time."""

    def __init__(
        self,
        schedule: Schedule,
        costs: Sequence[StageCost],
        stop: int,
        overhead: float,
        contention: float,
    ) -> None:
        k = schedule.num_workers
        self.schedule, self.costs, self.stop, self.overhead = schedule, costs, stop, overhead
        self.contention = contention
        self.split = {(a.stage, a.microbatch) for w in schedule.actions for a in w if a.kind == "W"}
        self.end: dict[Action, float] = {}
        self.cursor, self.phase = [0] * k, [""] * k  # phase: "", "pre" or "work"
        self.left, self.started, self.busy, self.replayed = (
            [0.0] * k,
            [0.0] * k,
            [0.0] * k,
            [0.0] * k,
        )
        self.pre_done = [False] * k
        self.t = 0.0
        self.timeline: list[TimedAction] = []
        # Per worker and action: what it waits for (with the send time when it crosses
        # workers), and when it may start once all of that is done (fixed from then on).
        self.needs = [[self._needs(a) for a in worker] for worker in schedule.actions]
        self.ready_at: list[float | None] = [None] * k

    def run(self) -> list[TimedAction]:
        total = sum(len(w) for w in self.schedule.actions)
        while len(self.timeline) < total:
            arrivals = self._start_ready()
            running = [w for w, p in enumerate(self.phase) if p]
            if not running:
                if not arrivals:
                    raise ValueError(f"schedule {self.schedule.name!r} deadlocks")
                self.t = min(arrivals)
                continue
            k = self.schedule.num_workers
            slowdown = 1.0 + (self.contention - 1.0) * (len(running) - 1) / max(1, k - 1)
            dt = min(self.left[w] for w in running) * slowdown
            if arrivals:
                dt = min(dt, min(arrivals) - self.t)
            self._advance(running, dt, 1.0 / slowdown)
        return self.timeline

    def _start_ready(self) -> list[float]:
        """Starts every phase that can start now; returns the future arrival times awaited."""
        arrivals: list[float] = []
        for w, worker in enumerate(self.schedule.actions):
            if self.phase[w] or self.cursor[w] == len(worker):
                continue
            a = worker[self.cursor[w]]
            cost = self.costs[a.stage]
            replay = a.microbatch < self.stop
            if a.kind == "B" and replay and cost.recompute > 0 and not self.pre_done[w]:
                self._begin(w, "pre", cost.recompute)
                continue
            ready = self._arrival(w)
            if ready is None:
                continue
            if ready > self.t:
                arrivals.append(ready)
                continue
            if a.kind == "F":
                work = cost.forward_no_grad if replay else cost.forward
            elif a.kind == "B":
                split = (a.stage, a.microbatch) in self.split
                work = cost.backward_input if split else cost.backward
            else:
                work = cost.weight
            self._begin(w, "work", work + self.overhead)
        return arrivals

    def _begin(self, w: int, phase: str, seconds: float) -> None:
        if not self.pre_done[w]:
            self.started[w] = self.t
        self.phase[w], self.left[w] = phase, seconds

    def _needs(self, a: Action) -> list[tuple[Action, float]]:
        placement = self.schedule.placement
        needs = []
        for d in dependencies(a, self.schedule.num_stages):
            boundary = min(d.stage, a.stage)
            crossing = placement[d.stage] != placement[a.stage]
            needs.append((d, self.costs[boundary].send if crossing else 0.0))
        return needs

    def _arrival(self, w: int) -> float | None:
        """When everything worker ``w``'s next action needs is at ``w``; None while something
        is not done."""
        if self.ready_at[w] is not None:
            return self.ready_at[w]
        ready = 0.0
        for d, send in self.needs[w][self.cursor[w]]:
            if d not in self.end:
                return None
            ready = max(ready, self.end[d] + send)
        self.ready_at[w] = ready
        return ready

    def _advance(self, running: list[int], dt: float, speed: float) -> None:
        self.t += dt
        for w in running:
            self.busy[w] += dt
            if self.phase[w] == "pre":
                self.replayed[w] += dt
            self.left[w] -= dt * speed
            if self.left[w] > 1e-12 * max(1.0, self.t):
                continue
            if self.phase[w] == "pre":
                self.pre_done[w], self.phase[w] = True, ""
                continue
            a = self.schedule.actions[w][self.cursor[w]]
            self.end[a] = self.t
            self.timeline.append(
                TimedAction(a, w, self.started[w], self.t, self.busy[w], self.replayed[w])
            )
            self.cursor[w] += 1
            self.ready_at[w] = None
            self.phase[w], self.pre_done[w] = "", False
            self.busy[w] = self.replayed[w] = 0.0


def peak_activations(schedule: Schedule, costs: Sequence[StageCost], stop: int) -> list[int]:
    """Per worker, the most activation bytes held at once (the executor's accounting)."""
    split = {(a.stage, a.microbatch) for w in schedule.actions for a in w if a.kind == "W"}
    peaks = []
    for worker in schedule.actions:
        held: dict[tuple[int, int], int] = {}
        live = peak = 0
        for a in worker:
            key, cost = (a.stage, a.microbatch), costs[a.stage]
            added = 0
            if a.kind == "F":
                added = cost.input_bytes + (0 if a.microbatch < stop else cost.activation_bytes)
            elif a.kind == "B" and a.microbatch < stop:
                added = cost.activation_bytes  # the recompute brings them back
            held[key] = held.get(key, 0) + added
            live += added
            peak = max(peak, live)
            if a.kind == "W" or (a.kind == "B" and key not in split):
                live -= held.pop(key)
        peaks.append(peak)
    return peaks
