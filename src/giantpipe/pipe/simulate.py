"""The pipeline simulator: any schedule, run against a cost per action instead of a model.

It replays a schedule exactly as the local executor runs it (each worker takes its actions in
order; an action starts when its worker is free and its inputs have arrived) and reports the
step time, the bubble and the peak memory of each worker. The costs come from a profile of the
real model on the real device (:func:`giantpipe.pipe.stage_profile.profile_stages`, or
``pipe.predict(x, y, loss_fn)``) or from a FLOP-and-byte model of a device (the planner,
:mod:`giantpipe.plan`).

How each action is timed, for stage s of micro-batch m (stage s on worker placement[s])::

    F  waits for the activation of stage s-1 (+ send time when s-1 is on another worker);
       runs ``forward``, or ``forward_no_grad`` if m will be re-materialized
    B  replays the forward first (``recompute``, if m is re-materialized; the executor does it
       before it waits, so it overlaps the wait), then waits for the gradient of stage s+1,
       then runs ``backward`` (or ``backward_input`` when the schedule has a W for it)
    W  runs ``weight`` as soon as the worker is free

Memory follows the executor's accounting: F keeps the stage input and, unless m is
re-materialized, the activations autograd saves; a recompute adds the activations back; B (or
W, where the backward is split) frees them all. Parameters, gradients and optimizer state are
``static_bytes``, resident throughout.

Example (equal costs: GPipe's bubble is exactly (K-1)/(M+K-1))::

    >>> costs = [StageCost(forward=1.0, backward=2.0)] * 4
    >>> sim = simulate(gpipe(4, 8), costs)
    >>> sim.step_time, round(sim.bubble, 4)
    (33.0, 0.2727)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from giantpipe.pipe.checkpoint import checkpoint_stop
from giantpipe.pipe.schedule import Action, Schedule, dependencies, gpipe

__all__ = ["Simulation", "StageCost", "TimedAction", "gpipe", "simulate"]


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
    checkpoint: str = "never",
    overhead: float = 0.0,
) -> Simulation:
    """Runs ``schedule`` against ``costs`` (one per stage) under a re-materialization mode.

    ``overhead`` seconds are added to every action (the executor's hand-over and bookkeeping).
    """
    if len(costs) != schedule.num_stages:
        raise ValueError(f"{len(costs)} stage costs for {schedule.num_stages} stages")
    stop = checkpoint_stop(checkpoint, schedule.num_microbatches)
    timeline = _timeline(schedule, costs, stop, overhead)
    span = max(t.end for t in timeline) - min(t.start for t in timeline)
    busy = [0.0] * schedule.num_workers
    for t in timeline:
        busy[t.worker] += t.busy
    k = schedule.num_workers
    bubble = max(0.0, 1.0 - sum(busy) / (k * span)) if span > 0 else 0.0
    activations = _peak_activations(schedule, costs, stop)
    static = [0] * k
    for stage, cost in enumerate(costs):
        static[schedule.placement[stage]] += cost.static_bytes
    peaks = [a + s for a, s in zip(activations, static)]
    return Simulation(schedule, span, busy, bubble, activations, peaks, timeline)


def _timeline(
    schedule: Schedule, costs: Sequence[StageCost], stop: int, overhead: float
) -> list[TimedAction]:
    """Times every action, taking them in an order where dependencies come first."""
    placement, last = schedule.placement, schedule.num_stages - 1
    split = {(a.stage, a.microbatch) for w in schedule.actions for a in w if a.kind == "W"}
    end: dict[Action, float] = {}
    free = [0.0] * schedule.num_workers
    timeline: list[TimedAction] = []
    cursors = [0] * schedule.num_workers
    while len(timeline) < sum(len(w) for w in schedule.actions):
        progressed = False
        for w, worker in enumerate(schedule.actions):
            while cursors[w] < len(worker):
                a = worker[cursors[w]]
                if not all(d in end for d in dependencies(a, schedule.num_stages)):
                    break
                cost, replay = costs[a.stage], a.microbatch < stop
                pre, work, ready = 0.0, 0.0, 0.0
                if a.kind == "F":
                    work = cost.forward_no_grad if replay else cost.forward
                    if a.stage > 0:
                        ready = end[Action("F", a.stage - 1, a.microbatch)]
                        ready += _send(costs, placement, a.stage - 1)
                elif a.kind == "B":
                    pre = cost.recompute if replay else 0.0
                    split_b = (a.stage, a.microbatch) in split
                    work = cost.backward_input if split_b else cost.backward
                    if a.stage < last:
                        ready = end[Action("B", a.stage + 1, a.microbatch)]
                        ready += _send(costs, placement, a.stage)
                else:
                    work = cost.weight
                start = free[w]
                finish = max(start + pre, ready) + work + overhead
                timeline.append(
                    TimedAction(
                        a,
                        w,
                        start if pre else max(start, ready),
                        finish,
                        pre + work + overhead,
                        pre,
                    )
                )
                end[a] = free[w] = finish
                cursors[w] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule.name!r} deadlocks")
    return timeline


def _send(costs: Sequence[StageCost], placement: Sequence[int], stage: int) -> float:
    """Seconds to cross the boundary after ``stage``; free between stages of one worker."""
    return costs[stage].send if placement[stage] != placement[stage + 1] else 0.0


def _peak_activations(schedule: Schedule, costs: Sequence[StageCost], stop: int) -> list[int]:
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
