"""Measured stage costs for the simulator, and the prediction of a pipeline's step from them.

Each stage is run alone on its device, on one micro-batch, the way the executor runs it: the
same intra-op threads, detached input leaves, the loss on the last stage. Timed (median of
``repeats`` after a warm-up): forward with and without autograd, the whole backward, and the
backward split into B (input gradients) and W (weight gradients). Counted: the bytes of the
stage input and of what autograd saves. Parameters' gradients and BatchNorm statistics are left
as they were, and dropout draws from a fixed seed.

CPU stand-ins share the machine's cores and memory bus: a stage runs slower while the other
workers compute too, as they do in the pipeline. So with ``placement`` (what :func:`predict`
passes for CPU stand-ins) every other worker runs forward and backward of one of its stages in
a loop while a stage is timed, and the costs carry the same contention as the real step.

Example::

    pipe = GPipe(model, [4, 4], devices=["cpu", "cpu"], chunks=8, schedule="1f1b")
    prediction = pipe.predict(x, y, nn.functional.mse_loss)   # or predict(pipe, x, y, loss)
    prediction.step_time_s, prediction.bubble, prediction.samples_per_s
    pipe.train_step(x, y, nn.functional.mse_loss)
    pipe.last_stats.span_s, pipe.last_stats.bubble           # measured, to compare
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from giantpipe.pipe.checkpoint import recomputing
from giantpipe.pipe.executor import (
    LossFn,
    LossSpec,
    StepConfig,
    StepRun,
    _make_leaves,
    _pair_gradients,
)
from giantpipe.pipe.memory import SavedTensorMeter
from giantpipe.pipe.microbatch import TensorOrTensors, as_tuple, batch_size, nbytes, scatter
from giantpipe.pipe.microbatch import to_device as move
from giantpipe.pipe.rng import rng_context
from giantpipe.pipe.schedule import Schedule
from giantpipe.pipe.simulate import Simulation, StageCost, simulate
from giantpipe.pipe.split_backward import backward_input

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

    def as_dict(self) -> dict[str, Any]:
        keep = ("step_time_s", "samples_per_s", "bubble", "peak_memory_bytes")
        return {k: v for k, v in asdict(self).items() if k in keep}


def predict(
    pipe: GPipe,
    inputs: TensorOrTensors,
    targets: TensorOrTensors | None = None,
    loss_fn: LossFn | None = None,
    repeats: int = 3,
    overhead: float | None = None,
) -> Prediction:
    """Profiles ``pipe``'s stages on the first micro-batch of ``inputs`` and simulates its
    schedule (``pipe.schedule``, ``pipe.chunks``, ``pipe.checkpoint``, ``pipe.placement``).

    ``overhead``: seconds the executor adds to each action; by default measured by
    :func:`executor_overhead`."""
    micro = scatter(inputs, pipe.chunks)[0]
    target, scale = None, 1.0
    if targets is not None and loss_fn is not None:
        target = scatter(targets, pipe.chunks)[0]
        scale = batch_size(target) / batch_size(targets)
    threads = pipe._step_config(False, None).threads_per_worker
    on_cpu = all(d.type == "cpu" for d in pipe.devices)
    costs = profile_stages(
        pipe.partitions,
        pipe.devices,
        micro,
        target,
        loss_fn,
        scale,
        repeats,
        threads,
        placement=pipe.placement if on_cpu else None,
    )
    schedule = pipe.step_schedule()
    if overhead is None:
        overhead = executor_overhead(schedule, pipe.devices, threads, repeats)
    sim = simulate(schedule, costs, pipe.checkpoint, overhead)
    total = batch_size(inputs)
    return Prediction(
        sim.step_time, sim.samples_per_second(total), sim.bubble, sim.peak_memory_bytes, sim, costs
    )


def executor_overhead(
    schedule: Schedule,
    devices: Sequence[torch.device],
    threads: int | None = None,
    repeats: int = 3,
) -> float:
    """Seconds the local executor adds to every action: hand-over through the mailbox, waking
    the waiting thread, bookkeeping. Runs ``schedule`` on stages that do nothing and divides its
    span by the simulated span of unit-cost actions."""
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
        run = StepRun(config, [torch.ones(1, 1, device=devices[0]) for _ in range(m)])
        run.run(schedule)
        spans.append(run.span)
    unit = StageCost(1.0, 1.0, backward_input=1.0, weight=1.0)
    return statistics.median(spans[1:]) / simulate(schedule, [unit] * k).step_time


def profile_stages(
    stages: Sequence[nn.Sequential],
    devices: Sequence[torch.device],
    sample: TensorOrTensors,
    target: TensorOrTensors | None = None,
    loss_fn: LossFn | None = None,
    loss_scale: float = 1.0,
    repeats: int = 3,
    threads: int | None = None,
    optimizer_slots: int = 0,
    placement: Sequence[int] | None = None,
) -> list[StageCost]:
    """One :class:`StageCost` per stage, the micro-batch ``sample`` flowing stage to stage.

    ``static_bytes`` counts parameters x (2 + ``optimizer_slots``): weights, gradients and the
    optimizer's per-parameter state (1 for momentum or RMSProp, 2 for Adam). With
    ``placement`` (the worker of each stage), the other workers keep busy while a stage is
    timed (see the module docstring).
    """
    inputs = _stage_inputs(stages, devices, sample)
    costs = []
    with _threads(threads):
        for s, stage in enumerate(stages):
            last = s == len(stages) - 1
            loss = _loss(loss_fn, target, loss_scale, devices[s]) if last else None
            with _busy_neighbours(stages, inputs, placement, s, threads):
                fields, y = _profile_stage(stage, inputs[s], devices[s], s == 0, loss, repeats)
            send = 0.0 if last else _send_time(y, devices[s], devices[s + 1], repeats)
            params = sum(p.numel() * p.element_size() for p in stage.parameters())
            static = params * (2 + optimizer_slots)
            costs.append(StageCost(**fields, send=send, static_bytes=static))
    return costs


def _stage_inputs(
    stages: Sequence[nn.Module], devices: Sequence[torch.device], sample: Any
) -> list[Any]:
    """The input of every stage: ``sample`` through the stages, without autograd."""
    inputs, x = [], sample
    with torch.no_grad():
        for stage, device in zip(stages, devices):
            x = move(x, device)
            inputs.append(x)
            with recomputing(stage), rng_context(0, 0, device):
                x = stage(x)
    return inputs


@contextmanager
def _busy_neighbours(
    stages: Sequence[nn.Module],
    inputs: Sequence[Any],
    placement: Sequence[int] | None,
    stage: int,
    threads: int | None,
) -> Iterator[None]:
    """While the body runs, each other worker loops forward + backward of its first stage (the
    last stage too: load needs no loss, a gradient of ones will do)."""
    if placement is None:
        yield
        return
    others: dict[int, int] = {}
    for s, w in enumerate(placement):
        if w != placement[stage] and w not in others:
            others[w] = s
    stop = threading.Event()
    workers = [
        threading.Thread(target=_keep_busy, args=(stages[s], inputs[s], s == 0, stop, threads))
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
    stage: nn.Module, x: Any, first: bool, stop: threading.Event, threads: int | None
) -> None:
    if threads:
        torch.set_num_threads(threads)
    params = list(stage.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None  # backward accumulates in place: profile on fresh gradients
    leaves = _make_leaves(x, first)
    device = next((t.device for t in as_tuple(x) if isinstance(t, torch.Tensor)), None)
    try:
        with recomputing(stage), rng_context(0, 0, device or torch.device("cpu")):
            while not stop.is_set():
                y = as_tuple(stage(leaves))
                outs = [t for t in y if isinstance(t, torch.Tensor) and t.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def _loss(
    loss_fn: LossFn | None, target: Any, scale: float, device: torch.device
) -> Callable[[Any], Any] | None:
    if loss_fn is None or target is None:
        return None
    on_device = move(target, device)
    return lambda y: loss_fn(y, on_device) * scale


def _profile_stage(
    stage: nn.Module,
    x: Any,
    device: torch.device,
    first: bool,
    loss: Callable[[Any], Any] | None,
    repeats: int,
) -> tuple[dict[str, Any], Any]:
    x = move(x, device)
    params = list(stage.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None  # backward accumulates in place: profile on fresh gradients
    leaves = _make_leaves(x, first)

    def run() -> Any:
        y = stage(leaves)
        return loss(y) if loss is not None else y

    def grads(y: Any) -> tuple[list[torch.Tensor], list[Any]]:
        if loss is not None:
            return [y], [None]
        return _pair_gradients(as_tuple(y), tuple(_ones(t) for t in as_tuple(y)), device)

    def full_backward() -> float:
        tensors, out_grads = grads(run())
        start = time.perf_counter()
        torch.autograd.backward(tensors, out_grads)
        return _sync(device, time.perf_counter) - start

    def split_backward() -> tuple[float, float]:
        tensors, out_grads = grads(run())
        start = time.perf_counter()
        _, weight = backward_input(tensors, out_grads, as_tuple(leaves), params)
        middle = _sync(device, time.perf_counter)
        weight.run()
        return middle - start, _sync(device, time.perf_counter) - middle

    try:
        with recomputing(stage), rng_context(0, 0, device):  # BatchNorm statistics untouched
            meter = SavedTensorMeter(exclude=params)
            meter.ignore(as_tuple(leaves))
            with meter:
                y = run()  # the loss too, on the last stage: the executor meters it there
            forward = _median(run, repeats, device)
            with torch.no_grad():
                forward_no_grad = _median(run, repeats, device)
            backward = statistics.median([full_backward() for _ in range(repeats + 1)][1:])
            halves = [split_backward() for _ in range(repeats + 1)][1:]
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    fields = {
        "forward": forward,
        "forward_no_grad": forward_no_grad,
        "recompute": forward,
        "backward": backward,
        "backward_input": statistics.median(h[0] for h in halves),
        "weight": statistics.median(h[1] for h in halves),
        "input_bytes": nbytes(leaves),
        "activation_bytes": meter.bytes,
    }
    return fields, _detach(y)


def _median(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats + 1):  # the first run warms up caches and kernels
        start = time.perf_counter()
        fn()
        samples.append(_sync(device, time.perf_counter) - start)
    return statistics.median(samples[1:])


def _send_time(y: Any, src: torch.device, dst: torch.device, repeats: int) -> float:
    if src == dst:
        return 0.0
    return _median(lambda: move(y, dst), repeats, dst)


def _sync(device: torch.device, clock: Callable[[], float]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


def _ones(t: Any) -> Any:
    return torch.ones_like(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else None


def _detach(y: Any) -> Any:
    if isinstance(y, torch.Tensor):
        return y.detach()
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in y)


@contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
