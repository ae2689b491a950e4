"""The simulator's forecast of a pipeline's step, from its stages measured on this machine.

    prediction = pipe.predict(x, y, nn.functional.cross_entropy)   # GPipe.predict calls predict
    pipe.train_step(x, y, nn.functional.cross_entropy)
    prediction.step_time_s, pipe.last_stats.wall_time_s             # predicted, measured
    prediction.bubble, pipe.last_stats.bubble

Three measurements feed :func:`~giantpipe.pipe.simulate.simulate`:

- each stage alone (:func:`~giantpipe.pipe.stage_profile.profile_stages`);
- the executor's own cost per action (:func:`executor_overhead`): hand-over through the
  mailbox, waking the waiting thread, bookkeeping;
- on CPU stand-ins, which share the machine's cores and memory bus, how much slower a stage
  runs while every other worker computes too (:func:`measure_contention`); the simulator slows
  only the actions that really overlap.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from giantpipe.pipe.executor import LossFn, LossSpec, StepConfig, StepRun
from giantpipe.pipe.leaves import make_leaves
from giantpipe.pipe.memory import SavedTensorMeter
from giantpipe.pipe.microbatch import TensorOrTensors, as_tuple, batch_size, scatter
from giantpipe.pipe.rng import rng_context
from giantpipe.pipe.schedule import Schedule
from giantpipe.pipe.simulate import Simulation, StageCost, simulate
from giantpipe.pipe.stage_profile import (
    median_time,
    on_worker_thread,
    preserved_state,
    profile_stages,
    stage_inputs,
)
from giantpipe.pipe.workers import WorkerPool

if TYPE_CHECKING:
    from giantpipe.pipe.gpipe import GPipe


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
    contention: float  # slowdown of a stage while all workers run (1: none)

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
    """Profiles ``pipe``'s stages on the first micro-batch of ``inputs`` and simulates its
    schedule (``pipe.schedule``, ``pipe.chunks``, ``pipe.checkpoint``, ``pipe.placement``)."""
    micro = scatter(inputs, pipe.chunks)[0]
    target, scale = None, 1.0
    if targets is not None and loss_fn is not None:
        target = scatter(targets, pipe.chunks)[0]
        scale = batch_size(target) / batch_size(targets)
    rng = torch.get_rng_state()
    threads = pipe._step_config(False, None).threads_per_worker
    torch.set_rng_state(rng)  # _step_config draws a step seed: leave the caller's RNG alone
    stages, devices = pipe.partitions, pipe.devices
    costs = profile_stages(stages, devices, micro, target, loss_fn, scale, repeats, threads)
    schedule = pipe.step_schedule()
    overhead = executor_overhead(schedule, devices, threads, repeats, pipe._worker_pool)
    contention = 1.0
    if pipe.num_workers > 1 and all(d.type == "cpu" for d in devices):
        contention = measure_contention(stages, devices, micro, pipe.placement, threads, repeats)
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
        checkpoint_stop=0,
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


def measure_contention(
    stages: Sequence[nn.Module],
    devices: Sequence[torch.device],
    sample: TensorOrTensors,
    placement: Sequence[int],
    threads: int | None = None,
    repeats: int = 3,
) -> float:
    """How much slower a stage's forward + backward runs while every other worker runs its
    own in a loop than alone: the median over stages of that ratio, at least 1. Each runs as
    the executor runs it (worker thread, saved-tensor meter, deferred BatchNorm accumulating,
    RNG hooks), so the Python work that two workers serialise on the GIL is in the ratio too;
    buffers and BatchNorm accumulators are put back afterwards."""
    inputs = stage_inputs(stages, devices, sample)
    ratios = []
    with ExitStack() as kept:
        for stage in stages:
            kept.enter_context(preserved_state(stage))
        for s, stage in enumerate(stages):
            step = _forward_backward(stage, inputs[s], s == 0, devices[s])
            timed = partial(median_time, step, repeats, devices[s])
            alone = on_worker_thread(timed, threads, devices)
            with _busy_neighbours(stages, inputs, placement, s, threads):
                together = on_worker_thread(timed, threads, devices)
            ratios.append(together / alone if alone > 0 else 1.0)
    return max(1.0, statistics.median(ratios))


def _forward_backward(stage: nn.Module, x: Any, first: bool, device: torch.device) -> Any:
    leaves = make_leaves(x, first)
    params = list(stage.parameters())

    def step() -> None:
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None  # backward accumulates in place: keep the caller's gradients apart
        try:
            # as the executor runs it: metered, deferred BatchNorm accumulating (put back by
            # the caller), RNG hooks seeded
            with rng_context(0, 0, device), SavedTensorMeter(exclude=params):
                outs = [
                    t for t in as_tuple(stage(leaves)) if torch.is_tensor(t) and t.requires_grad
                ]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        finally:
            for p, g in zip(params, saved):
                p.grad = g

    return step


@contextmanager
def _busy_neighbours(
    stages: Sequence[nn.Module],
    inputs: Sequence[Any],
    placement: Sequence[int],
    stage: int,
    threads: int | None,
) -> Iterator[None]:
    """While the body runs, each other worker loops forward + backward of its first stage (the
    last stage too: load needs no loss, a gradient of ones will do)."""
    others: dict[int, int] = {}
    for s, w in enumerate(placement):
        if w != placement[stage] and w not in others:
            others[w] = s
    stop = threading.Event()
    # new threads start with autocast off: give them the caller's, as the executor does
    types = {t.device.type for x in inputs for t in as_tuple(x) if torch.is_tensor(t)}
    casts = [(t, torch.get_autocast_dtype(t)) for t in types if torch.is_autocast_enabled(t)]
    workers = [
        threading.Thread(
            target=_keep_busy, args=(stages[s], inputs[s], s == 0, stop, threads, casts)
        )
        for s in others.values()
    ]
    for t in workers:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in workers:
            t.join()


def _keep_busy(
    stage: nn.Module,
    x: Any,
    first: bool,
    stop: threading.Event,
    threads: int | None,
    casts: Sequence[tuple[str, torch.dtype]] = (),
) -> None:
    if threads:
        torch.set_num_threads(threads)
    device = next((t.device for t in as_tuple(x) if torch.is_tensor(t)), torch.device("cpu"))
    step = _forward_backward(stage, x, first, device)
    with ExitStack() as stack:
        for device_type, dtype in casts:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        while not stop.is_set():
            step()
