"""Measured stage costs for the simulator: each stage alone on its device, on one micro-batch.

Each stage runs the way the executor runs it: the same intra-op threads, detached input leaves,
the loss on the last stage. Timed (median of ``repeats`` after a warm-up): forward with and
without autograd, the whole backward, and the backward split into B (input gradients) and W
(weight gradients). Counted: the bytes of the stage input and of what autograd saves.
Parameters' gradients and BatchNorm statistics are left as they were, and dropout draws from
a fixed seed. :mod:`giantpipe.pipe.predict` turns these costs into a forecast of a step.

Example::

    costs = profile_stages(pipe.partitions, pipe.devices, x[:8], y[:8], loss_fn, 8 / len(x))
    costs[0].forward, costs[0].backward, costs[0].activation_bytes
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from giantpipe.pipe.checkpoint import recomputing
from giantpipe.pipe.leaves import make_leaves, pair_gradients
from giantpipe.pipe.memory import SavedTensorMeter
from giantpipe.pipe.microbatch import TensorOrTensors, as_tuple, nbytes
from giantpipe.pipe.microbatch import to_device as move
from giantpipe.pipe.rng import rng_context
from giantpipe.pipe.simulate import StageCost
from giantpipe.pipe.split_backward import backward_input
from giantpipe.pipe.step_config import LossFn


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
) -> list[StageCost]:
    """One :class:`StageCost` per stage, the micro-batch ``sample`` flowing stage to stage.

    ``static_bytes`` counts parameters x (2 + ``optimizer_slots``): weights, gradients and the
    optimizer's per-parameter state (1 for momentum or RMSProp, 2 for Adam).
    """
    inputs = stage_inputs(stages, devices, sample)
    costs = []
    with intra_op_threads(threads):
        for s, stage in enumerate(stages):
            last = s == len(stages) - 1
            loss = _loss(loss_fn, target, loss_scale, devices[s]) if last else None
            fields, y = _profile_stage(stage, inputs[s], devices[s], s == 0, loss, repeats)
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
) -> tuple[dict[str, Any], Any]:
    x = move(x, device)
    params = list(stage.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None  # backward accumulates in place: profile on fresh gradients
    leaves = make_leaves(x, first)

    def run() -> Any:
        y = stage(leaves)
        return loss(y) if loss is not None else y

    def grads(y: Any) -> tuple[list[torch.Tensor], list[Any]]:
        if loss is not None:
            return [y], [None]
        return pair_gradients(as_tuple(y), tuple(_ones(t) for t in as_tuple(y)), device)

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
            forward = median_time(run, repeats, device)
            with torch.no_grad():
                forward_no_grad = median_time(run, repeats, device)
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


def median_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats + 1):  # the first run warms up caches and kernels
        start = time.perf_counter()
        fn()
        samples.append(_sync(device, time.perf_counter) - start)
    return statistics.median(samples[1:])


def _send_time(y: Any, src: torch.device, dst: torch.device, repeats: int) -> float:
    if src == dst:
        return 0.0
    return median_time(lambda: move(y, dst), repeats, dst)


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
def intra_op_threads(threads: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
