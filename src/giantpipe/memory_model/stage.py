"""Peak memory of one pipeline stage over one real training step, run by the engine itself.

The stage runs the engine's own actions (:class:`giantpipe.engine.executor.StepRun`'s ``forward``
and ``backward``, in the order the schedule gives this stage, with the engine's
re-materialization) and then a real optimizer step. Only this stage is on the "device": its
input activations are made when the schedule would receive them, its outputs and input
gradients are dropped when they would be sent on. The step runs in the caller's thread (the
engine's workers are threads, and fake-tensor and dispatch modes are thread-local), so:

- under fake tensors, :class:`~giantpipe.memory_model.tracker.LiveBytes` counts live bytes;
- on CUDA, the allocator's ``max_memory_allocated`` does.

The optimizer state exists before the step (as from step 2 on), gradients are set to None after
it, as ``zero_grad()`` does, so the peak is the steady-state one.

Under GPipe's fill-drain schedule each extra micro-batch adds exactly what one forward leaves
on the device (its stored input; its activations under 'never') and its target, so with
``extrapolate`` the step runs M = 2 and is extended linearly to M (tests check this against
direct runs); other schedules run all M micro-batches.

Example::

    with torch.device("meta"):
        model = amoebanetd(18, 208)
    mem = measure_stage(model[:8], spec_of(torch.empty(1, 3, 224, 224)), chunks=128,
                        checkpoint="always")
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
from torch._subclasses.fake_tensor import FakeTensorMode

from giantpipe.engine.executor import LossFn, LossSpec, StepConfig, StepRun
from giantpipe.engine.recompute import recompute_stop
from giantpipe.engine.schedules import build_schedule
from giantpipe.memory_model.specs import Spec, make, make_grads, spec_bytes, spec_of
from giantpipe.memory_model.tracker import LiveBytes, storage_bytes

OPTIMIZERS = ("rmsprop", "sgd", "adam")


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
    microbatches: str  # how M was measured: "128", or "2->128" (extrapolated from M = 2)

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


@dataclass(frozen=True)
class StageLoss:
    """The last stage's loss: ``fn(output, target)``, targets made from ``target`` per chunk."""

    fn: LossFn
    target: Spec


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
    checkpoint: str,
    schedule: str = "gpipe",
    stage_index: int = 0,
    num_stages: int = 1,
    loss: StageLoss | None = None,
    optimizer: str = "rmsprop",
    extrapolate: bool = True,
) -> StageMemory:
    """Peak bytes of ``stage`` over one training step of ``chunks`` micro-batches.

    ``spec``: one micro-batch's input to the stage (``grad=True`` on floats unless it is the
    first stage). ``loss`` is given for the last stage only. ``stage`` may be on the meta device
    (a copy is materialized on the GPU if there is one, else as fake tensors), fake, or real
    CPU tensors (measured as they are).
    """
    # Fill-drain: run M = 2 and add, per further micro-batch, what a forward leaves on the
    # device (its stored input, or all its activations under 'never') and its target. With a
    # single micro-batch the step would lack the "M - 1 inputs + all weight gradients" moment.
    probe = 2 if extrapolate and schedule == "gpipe" and chunks > 2 else chunks
    with _measuring(stage) as (target, meter, device):
        run = functools.partial(
            _run_step, target, spec, device, meter, checkpoint=checkpoint, schedule=schedule,
            stage_index=stage_index, num_stages=num_stages, loss=loss,
        )  # fmt: skip
        memory = _measure(target, meter, run, probe, optimizer)
    if probe == chunks:
        return memory
    per_microbatch = memory.per_microbatch + (spec_bytes(loss.target) if loss else 0)
    return replace(
        memory,
        step_peak=memory.step_peak + (chunks - probe) * per_microbatch,
        microbatches=f"{probe}->{chunks}",
    )


def _measure(
    stage: nn.Sequential,
    meter: Any,
    run: Callable[[int], tuple[int, int]],
    chunks: int,
    optimizer: str,
) -> StageMemory:
    params = list(stage.parameters())
    weights = meter.track([*params, *stage.buffers()])
    opt = make_optimizer(optimizer, params)
    _init_optimizer_state(opt, params)
    slots = meter.live - weights
    meter.reset_peak()
    grads, first_forward = run(chunks)
    step_peak = meter.peak
    meter.reset_peak()
    opt.step()
    optimizer_peak = meter.peak
    opt.zero_grad(set_to_none=True)
    return StageMemory(
        params=sum(p.numel() for p in params),
        weights=weights,
        optimizer=slots,
        grads=grads,
        step_peak=step_peak,
        optimizer_peak=optimizer_peak,
        per_microbatch=first_forward,
        microbatches=str(chunks),
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
    meter: Any,
    chunks: int,
    *,
    checkpoint: str,
    schedule: str,
    stage_index: int,
    num_stages: int,
    loss: StageLoss | None,
) -> tuple[int, int]:
    """Runs this stage's actions of ``schedule`` with the engine.

    Returns the bytes of the weight gradients and the bytes the first forward left alive.
    """
    loss_spec = None
    if loss is not None:
        targets = [make(loss.target, device) for _ in range(chunks)]
        loss_spec = LossSpec(loss.fn, targets, [1.0 / chunks] * chunks)
    config = StepConfig(
        stages=[stage],
        devices=[device],
        recompute_stop=recompute_stop(checkpoint, chunks),
        grad_enabled=True,
        seed=0,
        loss=loss_spec,
    )
    run = StepRun(config, [])
    plan = build_schedule(schedule, num_stages, chunks)
    outputs: dict[int, Spec] = {}
    first_forward = -1
    for action in plan.actions[plan.placement[stage_index]]:
        if action.stage != stage_index:
            continue
        m = action.microbatch
        if action.kind == "F":
            before = meter.live
            run.mailbox.put(("act", 0, m), make(spec, device))
            run.forward(0, m)
            sent = run.results.pop(m, None)  # handed to the next stage: off this device
            if sent is not None:
                outputs[m] = spec_of(sent)
            del sent
            if first_forward < 0:
                first_forward = meter.live - before
        elif action.kind == "B":
            if loss is None:
                run.mailbox.put(("grad", 0, m), make_grads(outputs.pop(m), device))
            run.backward(0, m)
            run.input_grads.pop(m, None)  # sent to the previous stage
        else:
            raise ValueError(f"cannot size action {action} (the local executor runs F and B)")
    grads = storage_bytes(p.grad for p in stage.parameters() if p.grad is not None)
    return grads, first_forward


def as_fake(module: nn.Module) -> tuple[nn.Module, FakeTensorMode]:
    """Turns a meta ``module`` into fake CPU tensors, in place; returns it and its fake mode.

    A module whose tensors are already fake is returned as it is. Fake tensors have shapes and
    storages with sizes, no data: a 5B-parameter stage costs nothing to hold.

    >>> with torch.device("meta"):
    ...     layer = nn.Linear(4, 4)
    >>> fake, mode = as_fake(layer)
    >>> type(fake.weight.data).__name__, fake.weight.device.type
    ('FakeTensor', 'cpu')
    """
    param = next(module.parameters())
    mode = getattr(param, "fake_mode", None)
    if mode is not None:
        return module, mode
    if param.device.type != "meta":
        raise ValueError(f"expected meta or fake parameters, got {param.device} tensors")
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}  # tied parameters stay tied
    with mode:
        for sub in module.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(_empty_like(p), p.requires_grad)
                setattr(sub, name, made[id(p)])
            for name, b in list(sub.named_buffers(recurse=False)):
                setattr(sub, name, _empty_like(b))
    return module, mode


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


@contextlib.contextmanager
def _measuring(stage: nn.Sequential) -> Iterator[tuple[nn.Sequential, Any, torch.device]]:
    """Where ``stage`` is measured: on the GPU if there is one (the meta stage materialized,
    measured by the allocator), else under fake tensors (measured by LiveBytes); a stage of
    real CPU tensors is measured by LiveBytes as it is (tests compare the two)."""
    param = next(stage.parameters())
    if param.device.type == "meta" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        meter = CudaMeter(device)
        real = copy.deepcopy(stage).to_empty(device=device)
        with torch.no_grad():
            for p in real.parameters():
                p.normal_(0.0, 0.02)  # finite values; the kernels' memory does not depend on them
        yield real, meter, device
        return
    if param.device.type == "meta" or getattr(param, "fake_mode", None) is not None:
        fake, mode = as_fake(stage)
        with warnings.catch_warnings():
            # The engine's own CPU accounting reads data pointers, which fake tensors lack.
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            with mode, LiveBytes() as meter:
                yield fake, meter, torch.device("cpu")  # type: ignore[misc]
        return
    with LiveBytes() as meter:
        yield stage, meter, param.device


class CudaMeter:
    """The :class:`LiveBytes` interface over the CUDA caching allocator's counters."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)
        self.base = torch.cuda.memory_allocated(device)

    @property
    def live(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base

    @property
    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def track(self, tensors: Any) -> int:
        return self.live  # already allocated: everything since the meter started

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
