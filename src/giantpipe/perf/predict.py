"""The simulator's forecast of a pipeline's step, from its stages measured on this machine.

Each stage profiled alone, each worker's actions replayed by the executor with nothing waiting,
the executor's hand-over per action and the workers' contention feed the simulator; this module
reads a pipe through :class:`PipeView` and the engine never imports it
(docs/performance.md#forecasting-a-step-from-measured-stages).

Example::

    prediction = predict(pipe, x, y, nn.functional.cross_entropy)  # pipe: a GPipe
    pipe.train_step(x, y, nn.functional.cross_entropy)
    prediction.step_time_s, pipe.last_stats.wall_time_s             # predicted, measured
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from giantpipe.engine.autograd import ones_gradient
from giantpipe.engine.executor import StepRun
from giantpipe.engine.mailbox import Key, Mailbox
from giantpipe.engine.microbatch import TensorOrTensors, as_tuple, batch_size, scatter
from giantpipe.engine.schedules.actions import Schedule
from giantpipe.engine.spec import PipelineSpec
from giantpipe.engine.stats import ActionTiming
from giantpipe.engine.step_config import LossFn, LossSpec, StepConfig
from giantpipe.engine.workers import WorkerPool
from giantpipe.perf.simulate import Simulation, StageCost, simulate
from giantpipe.perf.stage_profile import preserved_state, profile_stages, stage_inputs


class PipeView(Protocol):
    """What :func:`predict` reads of a pipe; ``giantpipe.GPipe`` has all of it.

    Example::

        pipe: PipeView = GPipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4)
    """

    partitions: list[nn.Sequential]  # the stages, in order
    devices: list[torch.device]  # per stage

    @property
    def spec(self) -> PipelineSpec:
        """The pipeline's shape: M, the re-materialization mode, the schedule."""
        ...

    @property
    def worker_pool(self) -> WorkerPool:
        """The pipe's worker threads, reused by the replay."""
        ...

    def step_config(self, grad: bool, loss: LossSpec | None) -> StepConfig:
        """The executor's configuration of a step (draws a step seed)."""
        ...


@dataclass(frozen=True)
class Prediction:
    """The simulator's forecast for one ``train_step`` of a pipeline."""

    step_time_s: float
    samples_per_s: float
    bubble: float
    peak_memory_bytes: list[int]  # per worker: activations (+ static, see profile_stages)
    simulation: Simulation
    costs: list[StageCost]
    overhead_s: float  # the executor's cost per action
    contention: float  # slowdown of the workers' actions while all run at once (1: none)

    def as_dict(self) -> dict[str, Any]:
        keep = ("step_time_s", "samples_per_s", "bubble", "peak_memory_bytes", "contention")
        return {k: v for k, v in asdict(self).items() if k in keep}


def predict(
    pipe: PipeView,
    inputs: TensorOrTensors,
    targets: TensorOrTensors | None = None,
    loss_fn: LossFn | None = None,
    repeats: int = 3,
) -> Prediction:
    """Profiles ``pipe``'s stages on the first micro-batch of ``inputs``, replays each
    worker's actions on all of them, and simulates its schedule (``pipe.spec``: the
    schedule, M and the re-materialization mode).

    Example::

        prediction = predict(pipe, x, y, nn.functional.cross_entropy)
        prediction.step_time_s, prediction.bubble, prediction.peak_memory_bytes
    """
    spec = pipe.spec
    micros = scatter(inputs, spec.chunks)
    target, scale, loss = None, 1.0, None
    if targets is not None and loss_fn is not None:
        micro_targets = scatter(targets, spec.chunks)
        target, total = micro_targets[0], batch_size(targets)
        scale = batch_size(target) / total
        loss = LossSpec(loss_fn, micro_targets, [batch_size(t) / total for t in micro_targets])
    rng = torch.get_rng_state()
    config = pipe.step_config(True, loss)
    torch.set_rng_state(rng)  # step_config draws a step seed: leave the caller's RNG alone
    threads = config.threads_per_worker
    stages, devices = pipe.partitions, pipe.devices
    costs = profile_stages(stages, devices, micros[0], target, loss_fn, scale, repeats, threads)
    schedule = spec.step_schedule()
    # the executor's own actions, in the schedule's order: their times replace the profile's
    passes = max(1, math.ceil(repeats / spec.chunks))
    replayed = replay(config, micros, schedule, passes, pipe.worker_pool)
    costs = replayed.costs(costs, config.recompute_stop)
    overhead = executor_overhead(schedule, devices, threads, repeats, pipe.worker_pool)
    contention = replayed.contention
    sim = simulate(schedule, costs, spec.recompute, overhead, contention)
    total = batch_size(inputs)
    return Prediction(
        sim.step_time,
        sim.samples_per_second(total),
        sim.bubble,
        sim.peak_memory_bytes,
        sim,
        costs,
        overhead,
        contention,
    )


def executor_overhead(
    schedule: Schedule,
    devices: Sequence[torch.device],
    threads: int | None = None,
    repeats: int = 3,
    pool: WorkerPool | None = None,
) -> float:
    """Seconds the local executor adds to every action: hand-over through the mailbox, waking
    the waiting thread, bookkeeping. Runs ``schedule`` on stages that do nothing (on ``pool``'s
    threads, as the pipe's steps do) and divides its span by the simulated span of unit-cost
    actions."""
    k, chunks = schedule.num_stages, schedule.chunks
    zeros: list[TensorOrTensors] = [torch.zeros(1, 1, device=devices[-1]) for _ in range(chunks)]
    config = StepConfig(
        stages=[nn.Sequential(nn.Identity()) for _ in range(k)],
        devices=devices,
        recompute_stop=0,
        grad_enabled=True,
        seed=0,
        loss=LossSpec(lambda y, t: (y * t).sum(), zeros, [1.0] * chunks),
        threads_per_worker=threads,
        placement=schedule.placement,
    )
    spans = []
    for _ in range(repeats + 1):
        run = StepRun(
            config, [torch.ones(1, 1, device=devices[0]) for _ in range(chunks)], pool=pool
        )
        run.run(schedule)
        spans.append(run.span)
    unit = StageCost(1.0, 1.0, backward_input=1.0, weight=1.0)
    return statistics.median(spans[1:]) / simulate(schedule, [unit] * k).step_time


# ---- the executor's own actions, replayed --------------------------------------------------


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

    def costs(self, costs: Sequence[StageCost], recompute_stop: int) -> list[StageCost]:
        """``costs`` with their times replaced by the medians of the replayed actions."""
        return [_measured(c, s, self.timings, recompute_stop) for s, c in enumerate(costs)]


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
    the busy time alone (rounds alternate, so the load of the moment cancels).

    Example::

        costs = profile_stages(pipe.partitions, pipe.devices, x[:8], y[:8], loss_fn, 8 / len(x))
        config = pipe.step_config(True, LossSpec(loss_fn, scatter(y, 4), [0.25] * 4))
        replayed = replay(config, scatter(x, 4), pipe.step_schedule())
        sim = simulate(pipe.step_schedule(), replayed.costs(costs, config.recompute_stop),
                       contention=replayed.contention)
    """
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
