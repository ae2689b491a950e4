"""Action costs measured by the executor itself: every worker's actions replayed alone.

:func:`~giantpipe.perf.stage_profile.profile_stages` times a stage by running its forward again
and again on one input. The executor does something else: a worker of 1F1B runs a forward
right after a backward of another micro-batch, each on fresh memory, with its bookkeeping
(mailbox, meter, RNG hooks) around every action. On CPU stand-ins that made the executor's
forwards 10-19% slower than the isolated profile's under 1F1B (8-block MLP, 64 rows per
micro-batch, 2 cores), and the forecast too optimistic by as much.

So :func:`replay` lets the executor run each worker's own action list of the real schedule, in
its order, on that worker's pool thread, with a mailbox that hands every action its activation
or gradient at once (:class:`CannedMailbox`): nothing waits, and every action is timed as in a
real step (:class:`~giantpipe.engine.stats.ActionTiming`). The median per stage and kind of action
replaces the profile's forward, backward, recompute and weight-gradient times. Then all workers
replay at once: their busy time against the sum of the lone replays is the contention between
them (CPU stand-ins share cores and memory bus; every worker's Python work shares the GIL).
Parameters' gradients, buffers and deferred BatchNorm's accumulators are put back afterwards.

Example::

    costs = profile_stages(pipe.partitions, pipe.devices, x[:8], y[:8], loss_fn, 8 / len(x))
    config = pipe._step_config(True, LossSpec(loss_fn, scatter(y, 4), [0.25] * 4))
    replayed = replay(config, scatter(x, 4), pipe.step_schedule())
    sim = simulate(pipe.step_schedule(), replayed.costs(costs, config.recompute_stop),
                   contention=replayed.contention)
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from giantpipe.engine.autograd import ones_gradient
from giantpipe.engine.executor import StepConfig, StepRun
from giantpipe.engine.microbatch import TensorOrTensors, as_tuple
from giantpipe.engine.schedule import Schedule
from giantpipe.engine.stats import ActionTiming
from giantpipe.engine.workers import Key, Mailbox, WorkerPool
from giantpipe.perf.simulate import StageCost
from giantpipe.perf.stage_profile import preserved_state, stage_inputs


class CannedMailbox(Mailbox):
    """A mailbox that has every activation and gradient ready and drops what is put into it:
    ``activations[s][m]`` is the input of stage ``s`` for micro-batch ``m``, ``gradients[s][m]``
    the gradient stage ``s`` receives for its output. Each ``get`` hands out a fresh copy, as a
    neighbour would."""

    def __init__(
        self, activations: Sequence[Sequence[Any]], gradients: Sequence[Sequence[Any]]
    ) -> None:
        super().__init__(timeout=float("inf"))
        self._activations, self._gradients = activations, gradients

    def put(self, key: Key, value: Any) -> None:
        pass

    def get(self, key: Key) -> Any:
        kind, stage, m = key
        source = self._activations if kind == "act" else self._gradients
        return _fresh(source[stage][m])


@dataclass(frozen=True)
class Replay:
    """What the replays measured: every action of every worker run alone, and how much more
    busy time the workers needed when they all ran at once (1: no slowdown)."""

    timings: list[ActionTiming]
    contention: float

    def costs(self, costs: Sequence[StageCost], checkpoint_stop: int) -> list[StageCost]:
        """``costs`` with their times replaced by the medians of the replayed actions."""
        return [_measured(c, s, self.timings, checkpoint_stop) for s, c in enumerate(costs)]


def replay(
    config: StepConfig,
    inputs: Sequence[TensorOrTensors],
    schedule: Schedule,
    passes: int = 1,
    pool: WorkerPool | None = None,
) -> Replay:
    """Replays ``schedule`` on ``inputs`` (the micro-batches) ``passes`` times after a warm-up:
    each round runs every worker's actions alone on its own thread of ``pool``, then all
    workers at once; the contention is the median over rounds of the busy time together over
    the busy time alone (rounds alternate, so the load of the moment cancels)."""
    activations, gradients = _boundaries(config, inputs)
    own = pool is None
    pool = pool if pool is not None else WorkerPool()
    timings: list[ActionTiming] = []
    ratios: list[float] = []
    stages = config.stages
    params = [p for stage in stages for p in stage.parameters()]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None  # backward accumulates in place: keep the caller's gradients apart
    with ExitStack() as kept:
        for stage in stages:
            kept.enter_context(preserved_state(stage))
        try:
            for r in range(passes + 1):  # the first round warms the threads up
                alone = 0.0
                for w, only in _each_alone(schedule):
                    run = StepRun(config, list(inputs), CannedMailbox(activations, gradients))
                    pool.run([_idle] * w + [partial(_alone, run, only, config.threads_per_worker)])
                    alone += sum(run.busy)
                    timings += run.timings if r else []
                if schedule.num_workers > 1:
                    mailbox = CannedMailbox(activations, gradients)
                    run = StepRun(config, list(inputs), mailbox, pool=pool)
                    run.run(schedule)
                    if r and alone > 0:
                        ratios.append(sum(run.busy) / alone)
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            if own:
                pool.close()
    return Replay(timings, max(1.0, statistics.median(ratios)) if ratios else 1.0)


def _each_alone(schedule: Schedule) -> list[tuple[int, Schedule]]:
    """Per worker with actions: the schedule cut down to that worker's actions."""
    cut = []
    for w, actions in enumerate(schedule.actions):
        if actions:
            only = tuple(a if v == w else () for v, a in enumerate(schedule.actions))
            cut.append((w, dataclasses.replace(schedule, actions=only)))
    return cut


def _alone(run: StepRun, schedule: Schedule, threads: int | None) -> None:
    # one worker's schedule runs inline on the calling (pool) thread: give it the executor's
    # share of the cores, as a worker thread of a full step gets
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        run.run(schedule)
    finally:
        torch.set_num_threads(before)


def _idle() -> None:
    pass


def _boundaries(
    config: StepConfig, inputs: Sequence[TensorOrTensors]
) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per stage and micro-batch: its input, and a gradient of ones for its output (the last
    stage's too, when there is no loss)."""
    stages, devices = config.stages, config.devices
    k = len(stages)
    activations: list[list[Any]] = [[] for _ in range(k)]
    gradients: list[list[Any]] = [[] for _ in range(k)]
    for x in inputs:
        # an identity stage after the last: its "input" is the last stage's output
        flow = stage_inputs([*stages, nn.Identity()], [*devices, devices[-1]], x)
        for s in range(k):
            activations[s].append(flow[s])
            gradients[s].append(tuple(ones_gradient(t) for t in as_tuple(flow[s + 1])))
    return activations, gradients


def _measured(cost: StageCost, stage: int, timings: Sequence[ActionTiming], stop: int) -> StageCost:
    """``cost`` with every time the replay observed for ``stage`` put in its place."""
    mine = [t for t in timings if t.action.stage == stage]
    split = {t.action.microbatch for t in mine if t.action.kind == "W"}

    def median(kind: str, pick: Any, minus_recompute: bool = False) -> list[float]:
        seconds = [
            t.work - (t.recompute if minus_recompute else 0.0)
            for t in mine
            if t.action.kind == kind and pick(t.action.microbatch)
        ]
        return [statistics.median(seconds)] if seconds else []

    found = {
        "forward": median("F", lambda m: m >= stop),
        "forward_no_grad": median("F", lambda m: m < stop),
        "backward": median("B", lambda m: m not in split, minus_recompute=True),
        "backward_input": median("B", lambda m: m in split, minus_recompute=True),
        "weight": median("W", lambda m: True),
    }
    recomputes = [t.recompute for t in mine if t.action.kind == "B" and t.action.microbatch < stop]
    if recomputes:
        found["recompute"] = [statistics.median(recomputes)]
    times: dict[str, Any] = {k: v[0] for k, v in found.items() if v}
    return dataclasses.replace(cost, **times)


def _fresh(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    return value
