"""The steps the GPU tests compare: a pipe's step and the plain model's, as :class:`Outcome`.

A pipe is a GPipe of a copy of the model on the run's devices (K workers, M = 2K, the schedule's
V, deferred BatchNorm), with the test-only fault the run injects. The reference is the plain
model run micro-batch by micro-batch (gradient accumulation, :mod:`giantpipe.testing`), each
run of layers on its own device under the dropout seeds the engine gives it::

    ref = plain_step(model, inputs, target, chunks=4, segments=[(len(model), device)])
    with closing(pipe_for(model, opts, "1f1b", "never")) as pipe:
        got = pipe_step(pipe, inputs, target)
    fp32_verdict(got, ref)   # tests/gpu/errors.py
"""

from __future__ import annotations

import copy
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from giantpipe.engine.rng import install_rng_hooks
from giantpipe.engine.schedules import build_schedule, schedule_builders
from giantpipe.perf.balance import even_balance
from giantpipe.testing import accumulate_micro_batches, plain_forward, step_seed
from giantpipe.testing.gpu import GpuOptions
from tests.gpu.mask_model import to

SEED = 7  # torch.manual_seed before every pipelined step: the step's dropout seed follows
MODES = ("always", "except_last", "never")  # the re-materialization modes (recompute=)


def virtual_stages(schedule: str, k: int, chunks: int) -> int:
    """The smallest V a schedule takes for (K, M): 2 for interleaved and zb-v, else 1."""
    for v in (1, 2):
        try:
            build_schedule(schedule, k, chunks, v)
            return v
        except ValueError:
            continue
    raise ValueError(f"schedule {schedule!r} takes neither V=1 nor V=2 for K={k}, M={chunks}")


def schedules() -> list[str]:
    """Every schedule the engine has (gpipe, 1f1b, interleaved, zb-h1, zb-v, and any later)."""
    return list(schedule_builders())


def autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """Autocast to ``dtype`` on ``device``'s type, or nothing for fp32."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def build_pipe(model: nn.Sequential, opts: GpuOptions, balance: list[int], **kwargs: Any) -> GPipe:
    """A GPipe of a copy of ``model`` on ``opts``'s devices, deferred BatchNorm on. ``kwargs``
    go to GPipe (``devices`` too, to override). Applies the test-only fault ``opts.inject``."""
    kwargs.setdefault("devices", opts.devices())
    pipe = GPipe(copy.deepcopy(model), balance, deferred_batch_norm=True, **kwargs)
    if opts.inject == "wrong":  # the pipe now runs another model than the reference
        with torch.no_grad():
            next(pipe.parameters()).mul_(1.01)
    if opts.inject == "hang":  # a stage that never returns, as a deadlocked device would
        pipe.partitions[-1].register_forward_pre_hook(_stall)
    return pipe


def pipe_for(model: nn.Sequential, opts: GpuOptions, schedule: str, mode: str) -> GPipe:
    """K = ``opts.workers`` workers, M = 2K, ``schedule`` with the V it takes, even stages."""
    k, chunks = opts.workers, 2 * opts.workers
    v = virtual_stages(schedule, k, chunks)
    balance = even_balance(len(model), k * v)
    return build_pipe(
        model, opts, balance, chunks=chunks, recompute=mode, schedule=schedule, virtual_stages=v
    )


def _stall(module: nn.Module, args: Any) -> None:
    threading.Event().wait()  # forever: the test's timeout must catch it and dump the stacks


@dataclass
class Outcome:
    """One training step as seen afterwards: the loss, every gradient and buffer (by the plain
    model's names), and the eval-mode outputs of the trained model."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    outputs: torch.Tensor | None = None


def _snapshot(module: nn.Module, loss: torch.Tensor, outputs: Any) -> Outcome:
    grads = {n: p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().cpu() for n, b in module.named_buffers()}
    out = outputs.detach().float().cpu() if isinstance(outputs, torch.Tensor) else None
    return Outcome(loss.detach().float().cpu(), grads, buffers, out)


def pipe_step(
    pipe: GPipe, inputs: Any, target: torch.Tensor, dtype: torch.dtype | None = None
) -> Outcome:
    """``pipe.train_step`` under ``dtype`` autocast from ``SEED``, then its eval outputs."""
    first, last = pipe.devices[0], pipe.devices[-1]
    torch.manual_seed(SEED)
    with autocast(last, dtype):
        loss = pipe.train_step(to(inputs, first), target.to(last), nn.functional.cross_entropy)
    return _snapshot(pipe, loss, eval_outputs(pipe, to(inputs, first), last, dtype))


def eval_outputs(module: nn.Module, inputs: Any, device: torch.device, dtype: Any) -> Any:
    """The no_grad forward in eval mode (running statistics, no dropout); back to train mode."""
    module.eval()
    try:
        with torch.no_grad(), autocast(device, dtype):
            return module(inputs)
    finally:
        module.train()


def plain_step(
    model: nn.Sequential,
    inputs: Any,
    target: torch.Tensor,
    chunks: int,
    segments: list[tuple[int, torch.device]],
    dtype: torch.dtype | None = None,
) -> Outcome:
    """The plain model's step, micro-batch by micro-batch, on a copy of ``model``; each
    segment (a number of layers, a device) runs under that device's dropout seeds, as a stage
    on that device does in the pipe."""
    plain, seed, loss = trained_copy(model, inputs, target, chunks, segments, dtype)
    plain.eval()
    with torch.no_grad(), autocast(segments[-1][1], dtype):
        outputs = plain_forward(plain, inputs, seed, 0, segments)
    return _snapshot(plain, loss, outputs)


def trained_copy(
    model: nn.Sequential,
    inputs: Any,
    target: torch.Tensor,
    chunks: int,
    segments: list[tuple[int, torch.device]],
    dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[nn.Sequential, int, torch.Tensor]:
    """A copy of ``model`` (deferred BatchNorm) that took the plain step from ``SEED``: the
    copy, the step's dropout seed and its loss (see :func:`plain_step`; ``scaler``: backward
    through it)."""
    plain = copy.deepcopy(model)
    convert_deferred_batch_norm(plain)
    hooks = install_rng_hooks(plain)
    seed = step_seed(SEED)
    losses = accumulate_micro_batches(
        plain, inputs, target, chunks, seed, nn.functional.cross_entropy,
        placement=segments, dtype=dtype, scaler=scaler,
    )  # fmt: skip
    loss_sum = torch.zeros(())
    for loss in losses:
        loss_sum += loss.float().cpu()
    commit_deferred_batch_norm(plain)
    for h in hooks:
        h.remove()
    return plain, seed, loss_sum
