"""Measured stage costs for the simulator: each stage alone on its device, on one micro-batch.

Each stage runs the way the executor runs it (its own thread, the meter, the RNG hooks, deferred
BatchNorm), timed forward, recompute, backward and B/W, and its bytes counted; buffers and
gradients are left as they were (docs/performance.md#forecasting-a-step-from-measured-stages).

Example::

    costs = profile_stages(pipe.partitions, pipe.devices, x[:8], y[:8], loss_fn, 8 / len(x))
    costs[0].forward, costs[0].backward, costs[0].activation_bytes
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from giantpipe.engine.autograd import make_leaves, ones_gradient, pair_gradients
from giantpipe.engine.microbatch import TensorOrTensors, as_tuple, nbytes
from giantpipe.engine.microbatch import to_device as move
from giantpipe.engine.recompute import recomputing
from giantpipe.engine.rng import rng_context
from giantpipe.engine.split_backward import backward_input
from giantpipe.engine.stats import SavedTensorMeter
from giantpipe.engine.step_config import LossFn, autocast_state
from giantpipe.perf.simulate import StageCost

Clock = Callable[[], float]
"""Seconds from an arbitrary origin (``time.perf_counter``; tests inject their own)."""

MAX_SPREAD = 0.5
"""Largest interquartile range of repeated timings, as a share of their median, that
:func:`~giantpipe.perf.balance.balance_by_time` and the planner's measurements trust (a busy
machine spreads them far wider)."""

NEGLIGIBLE = 0.01
"""Layers under this share of the total time cannot move a cut: their spread is not judged."""


class TimingNoise(UserWarning):
    """Repeated timings spread too far to trust (a busy machine)."""


def spread(runs: Sequence[float]) -> float:
    """Interquartile range of repeated timings over their median (0: all equal).

    >>> spread([1.0, 1.0, 1.0, 1.0, 1.0]), spread([1.0, 1.0, 2.0, 3.0, 3.0])
    (0.0, 1.0)
    """
    if len(runs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive")
    median = statistics.median(runs)
    return (q3 - q1) / median if median > 0 else 0.0


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
    clock: Clock = time.perf_counter,
    names: Sequence[str] | None = None,
) -> list[StageCost]:
    """One :class:`StageCost` per stage, the micro-batch ``sample`` flowing stage to stage.

    ``static_bytes`` counts parameters x (2 + ``optimizer_slots``): weights, gradients and the
    optimizer's per-parameter state (1 for momentum or RMSProp, 2 for Adam). Each time is the
    median of ``repeats`` runs; where a stage's runs spread more than :data:`MAX_SPREAD` (a
    busy machine), a :class:`TimingNoise` warning names the stage (``names[s]``, else "stage
    s") and the actions, and the medians are kept (the planner has no other figure for this
    machine's seconds).
    """
    inputs = stage_inputs(stages, devices, sample)
    costs = []
    with intra_op_threads(threads):
        for s, stage in enumerate(stages):
            last = s == len(stages) - 1
            loss = _loss(loss_fn, target, loss_scale, devices[s]) if last else None
            fields, y = on_worker_thread(
                partial(_profile_stage, stage, inputs[s], devices[s], s == 0, loss, repeats, clock),
                threads,
                devices,
            )
            _warn_noise(names[s] if names else f"stage {s}", fields.pop("runs"))
            send = 0.0 if last else _send_time(y, devices[s], devices[s + 1], repeats)
            params = sum(p.numel() * p.element_size() for p in stage.parameters())
            static = params * (2 + optimizer_slots)
            costs.append(StageCost(**fields, send=send, static_bytes=static))
    return costs


def stage_inputs(
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
    clock: Clock = time.perf_counter,
) -> tuple[dict[str, Any], Any]:
    probe = _Probe(stage, make_leaves(move(x, device), first), device, loss, clock)
    saved = [p.grad for p in probe.params]
    for p in probe.params:
        p.grad = None  # backward accumulates in place: profile on fresh gradients
    meter = SavedTensorMeter(exclude=probe.params)
    meter.ignore(as_tuple(probe.leaves))
    try:
        with preserved_state(stage), rng_context(0, 0, device):
            with meter:
                y = probe.run()  # the loss too, on the last stage: the executor meters it there
            fields = _timings(probe, repeats)
    finally:
        for p, g in zip(probe.params, saved):
            p.grad = g
    fields.update(input_bytes=nbytes(probe.leaves), activation_bytes=meter.bytes)
    return fields, _detach(y)


def _timings(probe: _Probe, repeats: int) -> dict[str, Any]:
    """Median seconds of each way the executor runs the stage (after a warm-up each), and under
    ``runs`` every timing, for the spread."""
    device, clock = probe.device, probe.clock
    runs: dict[str, list[float]] = {}
    runs["forward"] = timings(probe.metered, repeats, device, clock)
    with torch.no_grad():
        runs["forward_no_grad"] = timings(probe.run, repeats, device, clock)
    with recomputing(probe.stage):
        runs["recompute"] = timings(probe.metered, repeats, device, clock)
    runs["backward"] = [probe.full_backward() for _ in range(repeats + 1)][1:]
    halves = [probe.split_backward() for _ in range(repeats + 1)][1:]
    runs["backward_input"] = [h[0] for h in halves]
    runs["weight"] = [h[1] for h in halves]
    fields: dict[str, Any] = {name: statistics.median(r) for name, r in runs.items()}
    fields["runs"] = runs
    return fields


def _warn_noise(stage: str, runs: dict[str, list[float]]) -> None:
    total = statistics.median(runs["forward"]) + statistics.median(runs["backward"])
    noisy = [
        f"{name} {spread(r):.0%}"
        for name, r in runs.items()
        if statistics.median(r) >= NEGLIGIBLE * total and spread(r) > MAX_SPREAD
    ]
    if noisy:
        warnings.warn(
            f"{stage}: timings spread more than {MAX_SPREAD:.0%} (interquartile range "
            f"over median; the machine is busy): {', '.join(noisy)}; the medians are kept",
            TimingNoise,
            stacklevel=3,
        )


class _Probe:
    """One stage on one input (detached leaves), run each way the executor runs it."""

    def __init__(
        self,
        stage: nn.Module,
        leaves: Any,
        device: torch.device,
        loss: Callable[[Any], Any] | None,
        clock: Clock = time.perf_counter,
    ) -> None:
        self.stage, self.leaves, self.device, self.loss = stage, leaves, device, loss
        self.params = list(stage.parameters())
        self.clock = clock

    def run(self) -> Any:
        y = self.stage(self.leaves)
        return self.loss(y) if self.loss is not None else y

    def metered(self) -> Any:
        # the executor meters every forward it keeps for backward (Python hooks per tensor)
        with SavedTensorMeter(exclude=self.params):
            return self.run()

    def full_backward(self) -> float:
        tensors, out_grads = self._grads(self.metered())
        start = self.clock()
        torch.autograd.backward(tensors, out_grads)
        return _sync(self.device, self.clock) - start

    def split_backward(self) -> tuple[float, float]:
        tensors, out_grads = self._grads(self.metered())
        start = self.clock()
        _, weight = backward_input(tensors, out_grads, as_tuple(self.leaves), self.params)
        middle = _sync(self.device, self.clock)
        weight.run()
        return middle - start, _sync(self.device, self.clock) - middle

    def _grads(self, y: Any) -> tuple[list[torch.Tensor], list[Any]]:
        if self.loss is not None:
            return [y], [None]
        ones = tuple(ones_gradient(t) for t in as_tuple(y))
        return pair_gradients(as_tuple(y), ones, self.device)


def timings(
    fn: Callable[[], Any], repeats: int, device: torch.device, clock: Clock = time.perf_counter
) -> list[float]:
    """Seconds of ``repeats`` runs of ``fn``, after a warm-up run (caches, kernels)."""
    samples = []
    for _ in range(repeats + 1):
        start = clock()
        fn()
        samples.append(_sync(device, clock) - start)
    return samples[1:]


def median_time(
    fn: Callable[[], Any], repeats: int, device: torch.device, clock: Clock = time.perf_counter
) -> float:
    """Median seconds of ``repeats`` runs of ``fn`` (:func:`timings`)."""
    return statistics.median(timings(fn, repeats, device, clock))


def _send_time(y: Any, src: torch.device, dst: torch.device, repeats: int) -> float:
    if src == dst:
        return 0.0
    return median_time(lambda: move(y, dst), repeats, dst)


def _sync(device: torch.device, clock: Callable[[], float]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


def _detach(y: Any) -> Any:
    if isinstance(y, torch.Tensor):
        return y.detach()
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in y)


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def on_worker_thread(
    fn: Callable[[], Any], threads: int | None, devices: Sequence[torch.device]
) -> Any:
    """``fn()`` on a fresh thread set up as the executor sets up a worker (intra-op threads,
    the caller's grad mode and autocast): a fresh thread starts with a cold allocator, and the
    executor starts one per worker every step. Returns what ``fn`` returns, raises what it
    raises."""
    grad = torch.is_grad_enabled()
    casts = autocast_state(devices)
    result: list[Any] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            if threads:
                torch.set_num_threads(threads)
            with ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad))
                for device_type, dtype in casts:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            error.append(exc)

    worker = threading.Thread(target=body, name="giantpipe-profile")
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return result[0]


@contextmanager
def preserved_state(stage: nn.Module) -> Iterator[None]:
    """Runs the body with ``stage``'s buffers (BatchNorm running statistics, counters) and
    deferred BatchNorm's accumulators put back afterwards, so a profile may run the stage
    exactly as training does."""
    from giantpipe.engine.batchnorm import DeferredBatchNorm  # avoids an import cycle

    buffers = [(b, b.detach().clone()) for b in stage.buffers()]
    deferred = [
        (m, (m._count, m._mean, m._m2))  # noqa: SLF001
        for m in stage.modules()
        if isinstance(m, DeferredBatchNorm)
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, copy in buffers:
                buf.copy_(copy)
        for m, (count, mean, m2) in deferred:
            m._count, m._mean, m._m2 = count, mean, m2  # noqa: SLF001
