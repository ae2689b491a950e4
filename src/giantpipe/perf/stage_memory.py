"""Bytes a pipeline stage and its layers hold, measured by running them under the tracker.

:func:`measure_stage` runs one stage's real training step with the engine's own actions and an
optimizer step, alone on its "device"; :func:`profile_layer_memory` runs each layer once, from
which :mod:`.sizing` predicts (docs/performance.md#memory-without-allocating-it).

Example::

    with torch.device("meta"):
        model = amoebanetd(18, 208)
    mem = measure_stage(model[:8], spec_of(torch.empty(1, 3, 224, 224)), chunks=128,
                        recompute="always")
    mem.peak / 2**30   # GiB on this stage's device
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from giantpipe.engine.executor import StepRun
from giantpipe.engine.recompute import recompute_stop
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.step_config import LossSpec, StepConfig
from giantpipe.perf.memory import (
    AllocatorTracker,
    LiveBytesTracker,
    Spec,
    StageLoss,
    as_fake,
    make,
    make_grads,
    spec_bytes,
    spec_of,
    storage_bytes,
)

OPTIMIZERS = ("rmsprop", "sgd", "adam")
OPTIMIZER_SLOTS = {"rmsprop": 1, "sgd": 0, "adam": 2}
"""Copies of each parameter an optimizer keeps besides the weight and its gradient."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds on its device during a training step."""

    params: int  # parameter count
    weights: int  # parameters and buffers
    optimizer: int  # optimizer slots
    grads: int  # parameter gradients
    step_peak: int  # most bytes alive at once during forward and backward
    optimizer_peak: int  # most bytes alive at once during the optimizer step
    per_microbatch: int  # bytes the first forward leaves on the device until its backward
    chunks_measured: str  # how M was measured: "128", or "2->128" (extrapolated from M = 2)

    @property
    def peak(self) -> int:
        """Most bytes alive at once during the training step."""
        return max(self.step_peak, self.optimizer_peak)

    @property
    def param_memory(self) -> int:
        """Weights + gradients + optimizer slots (12 bytes a parameter with RMSProp)."""
        return self.weights + self.grads + self.optimizer

    @property
    def activations(self) -> int:
        """Everything else at the peak: stored inputs, recomputed activations, temporaries."""
        return self.peak - self.param_memory


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer whose state is counted. ``rmsprop`` keeps one slot (12 bytes a parameter
    with weight and gradient, the paper's figure), ``sgd`` none (8), ``adam`` two (16).

    ``foreach=False``: the multi-tensor kernels would add a temporary as large as all the
    parameters together, which the paper's 12 bytes do not include.
    """
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3, alpha=0.9, eps=1.0, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=False)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def measure_stage(
    stage: nn.Sequential,
    spec: Spec,
    *,
    chunks: int,
    recompute: str,
    schedule: str = "gpipe",
    stage_index: int = 0,
    num_stages: int = 1,
    loss: StageLoss | None = None,
    optimizer: str = "rmsprop",
    extrapolate: bool = True,
) -> StageMemory:
    """Peak bytes of ``stage`` over one training step of ``chunks`` micro-batches.

    ``spec``: one micro-batch's input to the stage (``grad=True`` on floats unless it is the
    first stage). ``recompute``: the re-materialization mode ('always', 'except_last',
    'never'). ``loss`` is given for the last stage only. ``stage`` may be on the meta device
    (a copy is materialized on the GPU if there is one, else as fake tensors), fake, or real
    CPU tensors (measured as they are).
    """
    # Fill-drain: run M = 2 and add, per further micro-batch, what a forward leaves on the
    # device (its stored input, or all its activations under 'never') and its target. With a
    # single micro-batch the step would lack the "M - 1 inputs + all weight gradients" moment.
    probe = 2 if extrapolate and schedule == "gpipe" and chunks > 2 else chunks
    with _measuring(stage) as (target, tracker, device):
        run = functools.partial(
            _run_step, target, spec, device, tracker, recompute=recompute, schedule=schedule,
            stage_index=stage_index, num_stages=num_stages, loss=loss,
        )  # fmt: skip
        memory = _measure(target, tracker, run, probe, optimizer)
    if probe == chunks:
        return memory
    per_microbatch = memory.per_microbatch + (spec_bytes(loss.target) if loss else 0)
    return replace(
        memory,
        step_peak=memory.step_peak + (chunks - probe) * per_microbatch,
        chunks_measured=f"{probe}->{chunks}",
    )


def _measure(
    stage: nn.Sequential,
    tracker: Any,
    run: Callable[[int], tuple[int, int]],
    chunks: int,
    optimizer: str,
) -> StageMemory:
    params = list(stage.parameters())
    weights = tracker.track([*params, *stage.buffers()])
    opt = make_optimizer(optimizer, params)
    _init_optimizer_state(opt, params)
    slots = tracker.live - weights
    tracker.reset_peak()
    grads, first_forward = run(chunks)
    step_peak = tracker.peak
    tracker.reset_peak()
    opt.step()
    optimizer_peak = tracker.peak
    opt.zero_grad(set_to_none=True)
    return StageMemory(
        params=sum(p.numel() for p in params),
        weights=weights,
        optimizer=slots,
        grads=grads,
        step_peak=step_peak,
        optimizer_peak=optimizer_peak,
        per_microbatch=first_forward,
        chunks_measured=str(chunks),
    )


def _init_optimizer_state(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    # One step on zero gradients creates the slots, as any step after the first finds them.
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _run_step(
    stage: nn.Sequential,
    spec: Spec,
    device: torch.device,
    tracker: Any,
    chunks: int,
    *,
    recompute: str,
    schedule: str,
    stage_index: int,
    num_stages: int,
    loss: StageLoss | None,
) -> tuple[int, int]:
    """Runs this stage's actions of ``schedule`` with the engine.

    Returns the bytes of the weight gradients and the bytes the first forward left alive.
    """
    run = StepRun(_stage_config(stage, device, chunks, recompute, loss), [])
    steps = build_schedule(schedule, num_stages, chunks)
    outputs: dict[int, Spec] = {}
    first_forward = -1
    for action in steps.actions[steps.placement[stage_index]]:
        if action.stage != stage_index:
            continue
        m = action.microbatch
        if action.kind == "F":
            before = tracker.live
            run.mailbox.put(("act", 0, m), make(spec, device))
            run.forward(0, m)
            sent = run.results.pop(m, None)  # handed to the next stage: off this device
            if sent is not None:
                outputs[m] = spec_of(sent)
            del sent
            if first_forward < 0:
                first_forward = tracker.live - before
        elif action.kind == "B":
            if loss is None:
                run.mailbox.put(("grad", 0, m), make_grads(outputs.pop(m), device))
            run.backward(0, m)
            run.input_grads.pop(m, None)  # sent to the previous stage
        else:
            raise ValueError(f"cannot size action {action} (the local executor runs F and B)")
    grads = storage_bytes(p.grad for p in stage.parameters() if p.grad is not None)
    return grads, first_forward


def _stage_config(
    stage: nn.Sequential, device: torch.device, chunks: int, mode: str, loss: StageLoss | None
) -> StepConfig:
    """The engine's step configuration for ``stage`` alone, re-materializing as ``mode`` says."""
    loss_spec = None
    if loss is not None:
        targets = [make(loss.target, device) for _ in range(chunks)]
        loss_spec = LossSpec(loss.fn, targets, [1.0 / chunks] * chunks)
    return StepConfig(
        stages=[stage],
        devices=[device],
        recompute_stop=recompute_stop(mode, chunks),
        grad_enabled=True,
        seed=0,
        loss=loss_spec,
    )


@contextlib.contextmanager
def _measuring(stage: nn.Sequential) -> Iterator[tuple[nn.Sequential, Any, torch.device]]:
    """Where ``stage`` is measured: on the GPU if there is one (the meta stage materialized,
    measured by the allocator), else under fake tensors (measured by LiveBytesTracker); a stage
    of real CPU tensors is measured by LiveBytesTracker as it is (tests compare the two)."""
    param = next(stage.parameters())
    if param.device.type == "meta" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        tracker = AllocatorTracker(device)
        real = copy.deepcopy(stage).to_empty(device=device)
        with torch.no_grad():
            for p in real.parameters():
                p.normal_(0.0, 0.02)  # finite values; the kernels' memory does not depend on them
        yield real, tracker, device
        return
    if param.device.type == "meta" or getattr(param, "fake_mode", None) is not None:
        fake, mode = as_fake(stage)
        with warnings.catch_warnings():
            # The engine's own CPU accounting reads data pointers, which fake tensors lack.
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            with mode, LiveBytesTracker() as tracker:
                yield fake, tracker, torch.device("cpu")  # type: ignore[misc]
        return
    with LiveBytesTracker() as tracker:
        yield stage, tracker, param.device


@dataclass(frozen=True)
class LayerMemory:
    """Bytes one layer holds for one micro-batch, as the tracker sees them (``params`` is a
    count). Not the planner's :class:`~giantpipe.perf.costs.LayerCost` (FLOPs and the bytes
    autograd saves, per sample): these are live bytes, backward temporaries included."""

    params: int
    resident: int  # weights, buffers, gradients, optimizer slots
    input: int  # its input as received from a previous device
    saved: int  # kept for backward by its forward, output included
    transient: int  # the most extra bytes during its backward (weight gradients exist)
    spec: Spec  # shape of its input (one micro-batch)
    weights: int = 0  # its parameters' bytes (in resident, with their gradients and slots)
    slots: int = 0  # optimizer slots per parameter (in resident)


def profile_layer_memory(
    model: nn.Sequential, spec: Spec, loss: StageLoss, optimizer: str = "rmsprop"
) -> list[LayerMemory]:
    """Runs each layer of ``model`` (meta or fake) forward and backward on one micro-batch.

    ``spec`` is the model's input; the last layer includes ``loss``. Saved bytes come from one
    forward through the whole chain (an output that no later backward needs is freed there, as
    in a stage's recompute); transients from each layer's backward on fresh inputs.

    Example::

        with torch.device("meta"):
            model = amoebanetd(9, 208)
        loss = StageLoss(F.cross_entropy, TensorSpec((4,), torch.long))
        costs = profile_layer_memory(model, TensorSpec((4, 3, 224, 224), torch.float32), loss)
    """
    slots = OPTIMIZER_SLOTS[optimizer]
    _, fake_mode = as_fake(model)  # in place
    with warnings.catch_warnings(), fake_mode, LiveBytesTracker() as mem:
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        # Resident already: a view of a weight (``w.t()`` in a linear) allocates nothing.
        mem.track([*model.parameters(), *model.buffers()])
        specs, saved = _chain_forward(model, spec, mem, loss)
        costs = []
        for i, layer in enumerate(model):
            last = i == len(model) - 1
            transient = _backward_transient(layer, specs[i], mem, loss if last else None)
            weights = storage_bytes(layer.parameters())
            costs.append(
                LayerMemory(
                    params=sum(p.numel() for p in layer.parameters()),
                    resident=weights * (2 + slots) + storage_bytes(layer.buffers()),
                    input=spec_bytes(specs[i]),
                    saved=saved[i],
                    transient=transient,
                    spec=specs[i],
                    weights=weights,
                    slots=slots,
                )
            )
    return costs


def _chain_forward(
    model: nn.Sequential, spec: Spec, mem: LiveBytesTracker, loss: StageLoss
) -> tuple[list[Spec], list[int]]:
    """Input spec and growth of live bytes of each layer in one forward through ``model``."""
    specs: list[Spec] = []
    saved: list[int] = []
    h = make(spec)
    for i, layer in enumerate(model):
        specs.append(spec_of(h, grad=i > 0))
        before = mem.live
        h = layer(h)
        if i == len(model) - 1:
            h = loss.fn(h, make(loss.target))
        saved.append(mem.live - before)
    return specs, saved


def _backward_transient(
    layer: nn.Module, spec: Spec, mem: LiveBytesTracker, loss: StageLoss | None
) -> int:
    """Most bytes a layer's backward adds beyond what is held when it starts.

    Weight gradients exist already (they do from a stage's second micro-batch on), so what
    is counted is the temporaries: activation gradients and the new gradient before it is
    accumulated.
    """
    params = list(layer.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    y = layer(make(spec))
    if loss is not None:
        y = loss.fn(y, make(loss.target))
    mem.reset_peak()
    start = mem.live
    tensors = [t for t in (y if isinstance(y, tuple) else (y,)) if t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, list(make_grads(spec_of(tuple(tensors)))))
    for p in params:
        p.grad = None
    return mem.peak - start
