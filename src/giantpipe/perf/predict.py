"""The simulator's forecast of a pipeline's step, from its stages measured on this machine.

    prediction = pipe.predict(x, y, nn.functional.cross_entropy)   # GPipe.predict calls predict
    pipe.train_step(x, y, nn.functional.cross_entropy)
    prediction.step_time_s, pipe.last_stats.wall_time_s             # predicted, measured
    prediction.bubble, pipe.last_stats.bubble

Four measurements feed :func:`~giantpipe.perf.simulate.simulate`:

- each stage alone (:func:`~giantpipe.perf.stage_profile.profile_stages`): the bytes it keeps
  for backward, and times for what the replay below does not run;
- each worker's own actions run by the executor in the schedule's order, alone, nothing waiting
  (:func:`~giantpipe.perf.replay.replay_costs`): forward, backward, recompute and weight-gradient
  times as a real step sees them;
- the executor's hand-over per action (:func:`executor_overhead`): mailbox, waking the waiting
  thread;
- how much more busy time the workers need when they all run at once than alone (the same
  replay, all workers together): CPU stand-ins share the machine's cores and memory bus, and
  every worker's Python work serialises on the GIL; the simulator slows only the actions that
  really overlap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from giantpipe.engine.executor import LossFn, LossSpec, StepConfig, StepRun
from giantpipe.engine.microbatch import TensorOrTensors, batch_size, scatter
from giantpipe.engine.schedule import Schedule
from giantpipe.engine.workers import WorkerPool
from giantpipe.perf.replay import replay
from giantpipe.perf.simulate import Simulation, StageCost, simulate
from giantpipe.perf.stage_profile import profile_stages

if TYPE_CHECKING:
    from giantpipe.engine.gpipe import GPipe


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
    pipe: GPipe,
    inputs: TensorOrTensors,
    targets: TensorOrTensors | None = None,
    loss_fn: LossFn | None = None,
    repeats: int = 3,
) -> Prediction:
    """Profiles ``pipe``'s stages on the first micro-batch of ``inputs``, replays each
    worker's actions on all of them, and simulates its schedule (``pipe.schedule``,
    ``pipe.chunks``, ``pipe.checkpoint``, ``pipe.placement``)."""
    micros = scatter(inputs, pipe.chunks)
    target, scale, spec = None, 1.0, None
    if targets is not None and loss_fn is not None:
        micro_targets = scatter(targets, pipe.chunks)
        target, total = micro_targets[0], batch_size(targets)
        scale = batch_size(target) / total
        spec = LossSpec(loss_fn, micro_targets, [batch_size(t) / total for t in micro_targets])
    rng = torch.get_rng_state()
    config = pipe._step_config(True, spec)
    torch.set_rng_state(rng)  # _step_config draws a step seed: leave the caller's RNG alone
    threads = config.threads_per_worker
    stages, devices = pipe.partitions, pipe.devices
    costs = profile_stages(stages, devices, micros[0], target, loss_fn, scale, repeats, threads)
    schedule = pipe.step_schedule()
    # the executor's own actions, in the schedule's order: their times replace the profile's
    passes = max(1, math.ceil(repeats / pipe.chunks))
    replayed = replay(config, micros, schedule, passes, pipe._worker_pool)
    costs = replayed.costs(costs, config.recompute_stop)
    overhead = executor_overhead(schedule, devices, threads, repeats, pipe._worker_pool)
    contention = replayed.contention
    sim = simulate(schedule, costs, pipe.checkpoint, overhead, contention)
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
    k, m = schedule.num_stages, schedule.num_microbatches
    zeros: list[TensorOrTensors] = [torch.zeros(1, 1, device=devices[-1]) for _ in range(m)]
    config = StepConfig(
        stages=[nn.Sequential(nn.Identity()) for _ in range(k)],
        devices=devices,
        recompute_stop=0,
        grad_enabled=True,
        seed=0,
        loss=LossSpec(lambda y, t: (y * t).sum(), zeros, [1.0] * m),
        threads_per_worker=threads,
        placement=schedule.placement,
    )
    spans = []
    for _ in range(repeats + 1):
        run = StepRun(config, [torch.ones(1, 1, device=devices[0]) for _ in range(m)], pool=pool)
        run.run(schedule)
        spans.append(run.span)
    unit = StageCost(1.0, 1.0, backward_input=1.0, weight=1.0)
    return statistics.median(spans[1:]) / simulate(schedule, [unit] * k).step_time
