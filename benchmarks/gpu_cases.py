"""The GPU check's cases (benchmarks/gpu_check.py runs each in a child process of its own), and
the child's entry point.

Correctness cases live here: every schedule x re-materialization mode equals the plain model in
fp32 and in bf16, fp16 with a gradient scaler, and the front door (``y = pipe(x);
loss.backward()``). Elsewhere: the copy/compute overlap and memory (gpu_perf.py),
throughput (gpu_speed.py), host synchronisation (gpu_sync.py), the distributed executor over
NCCL (gpu_dist.py). Every case returns a :class:`~gpu_common.Section` (rows of a table); a
row's verdict is pass or FAIL, or says why it is not judged here (``CUDA only``, ``needs 2
GPUs``, ``info``).

Example (what the child runs)::

    section = CASES["front-door"].run(Options(dry=True, quick=True, gpus=0))
    section.rows[0]   # ('gpipe / always', 'pass', '2.1e-07 (grad:3.fc.weight)', '<= 1e-05 ...')
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import gpu_dist
import gpu_perf
import gpu_speed
import gpu_sync
import torch
from gpu_common import (
    CUDA_ONLY,
    FP32_CRITERION,
    FP32_TOL,
    LOW_CRITERION,
    LOW_PRECISION_FACTOR,
    MODES,
    SEED,
    Options,
    Outcome,
    Section,
    Sizes,
    attempt,
    build_pipe,
    closing,
    errors,
    eval_outputs,
    even_balance,
    mask_batch,
    mask_model,
    pipe_for,
    pipe_step,
    plain_step,
    schedules,
    step_seed,
    to,
    worst,
    worst_ratio,
)
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from giantpipe.engine.rng import install_rng_hooks, rng_context


def judge(section: Section, check: str, got: Outcome, ref: Outcome, low: Outcome | None) -> None:
    """One row: ``got`` against the fp32 reference ``ref``; with ``low`` (the plain model in
    the same low precision), by the factor rule instead of the fp32 tolerance."""
    if low is None:
        name, err = worst(errors(got, ref))
        section.add(check, err <= FP32_TOL, f"{err:.1e} ({name})", FP32_CRITERION)
        return
    pipe_errs, plain_errs = errors(got, ref), errors(low, ref)
    name, factor = worst_ratio(pipe_errs, plain_errs)
    measured = f"{factor:.2f}x ({name}: {pipe_errs[name]:.1e} vs {plain_errs[name]:.1e})"
    section.add(check, factor <= LOW_PRECISION_FACTOR, measured, LOW_CRITERION)


# ---- transparency: every schedule x mode ------------------------------------------------------


def transparency(opts: Options, dtype: torch.dtype | None) -> Section:
    """Every schedule x re-materialization mode, K stages, M = 2K: the step's loss, every
    gradient, the deferred BatchNorm statistics and the eval outputs against the plain model."""
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    chunks = 2 * opts.workers
    whole = [(len(model), opts.device)]
    ref = plain_step(model, inputs, target, chunks, whole)
    low = plain_step(model, inputs, target, chunks, whole, dtype) if dtype is not None else None
    section = Section()
    for schedule in schedules():
        for mode in MODES:
            check = f"{schedule} / {mode}"

            def one(schedule: str = schedule, mode: str = mode, check: str = check) -> None:
                with closing(pipe_for(model, opts, schedule, mode)) as pipe:
                    judge(section, check, pipe_step(pipe, inputs, target, dtype), ref, low)

            attempt(section, check, LOW_CRITERION if dtype else FP32_CRITERION, one)
    if dtype is None:
        host_and_device(section, opts, model, chunks)
    where = ", ".join(str(d) for d in opts.devices())
    section.notes.append(
        f"K={opts.workers} on {where}, M={chunks}, {len(model)} layers (mask model: BatchNorm "
        f"deferred, dropout 0.1, int64 mask), batch {sizes.batch}; V=2 for interleaved, zb-v."
    )
    return section


def host_and_device(section: Section, opts: Options, model: nn.Sequential, chunks: int) -> None:
    """Stage 0 on the host, stage 1 on the GPU: values and gradients cross between devices (on
    one GPU, the only copy between devices a pipeline can make)."""
    check = "gpipe / except_last, stages on cpu + cuda:0"
    criterion = "host<->device copies between stages: " + FP32_CRITERION
    if opts.dry:
        section.add(check, CUDA_ONLY, "-", criterion)
        return
    inputs, target = mask_batch(Sizes.of(opts))
    balance = even_balance(len(model), 2)
    devices = [torch.device("cpu"), torch.device("cuda", 0)]

    def run() -> None:
        ref = plain_step(model, inputs, target, chunks, list(zip(balance, devices)))
        pipe = build_pipe(
            model, opts, balance, chunks=chunks, checkpoint="except_last", devices=devices
        )
        with closing(pipe):
            judge(section, check, pipe_step(pipe, inputs, target), ref, None)

    attempt(section, check, criterion, run)


def transparency_fp32(opts: Options) -> Section:
    return transparency(opts, None)


def transparency_bf16(opts: Options) -> Section:
    section = transparency(opts, torch.bfloat16)
    section.notes.append("bf16: autocast around train_step; plain = the same autocast step.")
    return section


# ---- fp16 with a gradient scaler ---------------------------------------------------------------

NORMAL, OVERFLOW = 2.0**8, 2.0**100  # initial scales: a step that fits fp16, one that cannot
SCALED_CRITERION = LOW_CRITERION + "; stepped; scale as the plain model's"
OVERFLOW_CRITERION = "both skip the step, scale halved alike"


@dataclass
class ScaledStep:
    """An fp16 step with a gradient scaler: unscaled gradients, whether the optimizer stepped,
    the scale after ``update()``."""

    outcome: Outcome
    stepped: bool
    scale: float


def optimizer_step(
    module: nn.Module, scaler: torch.amp.GradScaler, loss: torch.Tensor
) -> ScaledStep:
    """Reads the unscaled gradients, then ``scaler.step`` an SGD optimizer and ``update``."""
    scale = scaler.get_scale()
    grads = {
        n: p.grad.float().cpu() / scale for n, p in module.named_parameters() if p.grad is not None
    }
    before = [p.detach().clone() for p in module.parameters()]
    scaler.step(torch.optim.SGD(module.parameters(), lr=0.1))
    scaler.update()
    stepped = any(not torch.equal(b, p) for b, p in zip(before, module.parameters()))
    return ScaledStep(Outcome(loss.detach().float().cpu(), grads, {}), stepped, scaler.get_scale())


def plain_scaled(model: nn.Sequential, opts: Options, init_scale: float) -> ScaledStep:
    """The plain model's fp16 step with torch's GradScaler, micro-batch by micro-batch."""
    device, chunks = opts.device, 2 * opts.workers
    inputs, target = mask_batch(Sizes.of(opts))
    plain = convert_deferred_batch_norm(copy.deepcopy(model).to(device))
    hooks = install_rng_hooks(plain)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)
    seed, total, loss_sum = step_seed(), float(target.shape[0]), torch.zeros(())
    parts = zip(zip(*(t.tensor_split(chunks) for t in inputs)), target.tensor_split(chunks))
    for m, (x, y) in enumerate(parts):
        with rng_context(seed, m, device), torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(plain(to(x, device)), y.to(device))
        loss = loss * (y.shape[0] / total)
        scaler.scale(loss).backward()
        loss_sum += loss.detach().float().cpu()
    commit_deferred_batch_norm(plain)
    for h in hooks:
        h.remove()
    return optimizer_step(plain, scaler, loss_sum)


def pipe_scaled(
    model: nn.Sequential, opts: Options, schedule: str, init_scale: float
) -> ScaledStep:
    """The same step through ``pipe.train_step(..., grad_scaler=pipe.grad_scaler())``."""
    inputs, target = mask_batch(Sizes.of(opts))
    with closing(pipe_for(model, opts, schedule, "except_last")) as pipe:
        scaler = pipe.grad_scaler(init_scale=init_scale)
        first, last = pipe.devices[0], pipe.devices[-1]
        torch.manual_seed(SEED)
        with torch.autocast(last.type, dtype=torch.float16):
            loss = pipe.train_step(
                to(inputs, first), target.to(last), nn.functional.cross_entropy, grad_scaler=scaler
            )
        return optimizer_step(pipe, scaler, loss)


def scaled_row(section: Section, model: nn.Sequential, opts: Options, schedule: str,
               ref: Outcome, plain: ScaledStep) -> None:  # fmt: skip
    """The normal step: unscaled gradients by the factor rule, stepped, the plain model's scale."""
    got = pipe_scaled(model, opts, schedule, NORMAL)
    pipe_errs, plain_errs = errors(got.outcome, ref), errors(plain.outcome, ref)
    name, factor = worst_ratio(pipe_errs, plain_errs)
    same = got.stepped == plain.stepped and got.scale == plain.scale
    ok = factor <= LOW_PRECISION_FACTOR and same and got.stepped
    measured = f"{factor:.2f}x ({name}); stepped {got.stepped}; scale {got.scale:g}"
    section.add(f"{schedule}: scaled step", ok, measured, SCALED_CRITERION)


def overflow_row(section: Section, model: nn.Sequential, opts: Options, schedule: str,
                 plain: ScaledStep) -> None:  # fmt: skip
    """The overflowing step: skipped, and the scale halved as the plain model's."""
    over = pipe_scaled(model, opts, schedule, OVERFLOW)
    ok = not over.stepped and not plain.stepped and over.scale == plain.scale
    measured = f"stepped {over.stepped}; scale {over.scale:g} (plain {plain.scale:g})"
    section.add(f"{schedule}: overflow skipped", ok, measured, OVERFLOW_CRITERION)


def fp16_scaler(opts: Options) -> Section:
    """fp16 autocast with a gradient scaler, every schedule: a normal step (unscaled gradients
    against fp32 by the factor rule, the step taken, the scale as the plain model's) and an
    overflowing one (scale 2^100: the step skipped and the scale halved, as with the plain
    model). The normal step's scale, 2^8, leaves this model's fp16 gradients finite (2^16
    overflows the tiny dry-run model's largest gradient, about 1.0)."""
    section = Section()
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    ref = plain_step(model, inputs, target, 2 * opts.workers, [(len(model), opts.device)])
    ref = Outcome(ref.loss, ref.grads, {})
    plain, plain_over = plain_scaled(model, opts, NORMAL), plain_scaled(model, opts, OVERFLOW)
    for schedule in schedules():
        attempt(section, f"{schedule}: scaled step", SCALED_CRITERION,
                partial(scaled_row, section, model, opts, schedule, ref, plain))  # fmt: skip
        attempt(section, f"{schedule}: overflow skipped", OVERFLOW_CRITERION,
                partial(overflow_row, section, model, opts, schedule, plain_over))  # fmt: skip
    section.notes.append(f"Scaler: pipe.grad_scaler() (torch.amp.GradScaler for GPipe), "
                         f"M={2 * opts.workers}.")  # fmt: skip
    return section


# ---- the front door -------------------------------------------------------------------------


def front_door_step(pipe: GPipe, inputs: Any, target: torch.Tensor) -> Outcome:
    """``out = pipe(x); loss = f(out, y); loss.backward()``, then the eval outputs."""
    first = pipe.devices[0]
    torch.manual_seed(SEED)
    out = pipe(to(inputs, first))
    loss = nn.functional.cross_entropy(out, target.to(out.device))
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in pipe.named_parameters() if p.grad is not None}
    buffers = {n: b.cpu() for n, b in pipe.named_buffers()}
    outputs = eval_outputs(pipe, to(inputs, first), first, None).float().cpu()
    return Outcome(loss.detach().cpu(), grads, buffers, outputs)


def front_door(opts: Options) -> Section:
    """``y = pipe(x); loss = f(y); loss.backward()`` (torchgpipe's door: fill-drain, autograd
    calling back into the pipeline) equals the plain model; a hang is the case's timeout."""
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    ref = plain_step(model, inputs, target, 2 * opts.workers, [(len(model), opts.device)])
    section = Section()
    runs = [("gpipe", mode) for mode in MODES]
    runs += [("interleaved", "except_last"), ("zb-v", "except_last")]
    for schedule, mode in runs:
        check = f"{schedule} placement / {mode}"

        def one(schedule: str = schedule, mode: str = mode, check: str = check) -> None:
            with closing(pipe_for(model, opts, schedule, mode)) as pipe:
                judge(section, check, front_door_step(pipe, inputs, target), ref, None)

        attempt(section, check, FP32_CRITERION, one)
    section.notes.append("The front door always runs fill-drain (on the schedule's placement).")
    return section


# ---- the registry and the child --------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A case: what runs, what it proves (one line) and its timeout on a GPU, seconds (a
    ceiling, several times what it should take: reached only by a hang)."""

    run: Callable[[Options], Section]
    proves: str
    timeout: float


CASES: dict[str, Case] = {
    "transparency-fp32": Case(
        transparency_fp32,
        "every schedule x re-materialization mode equals the plain model, fp32",
        120.0,
    ),
    "transparency-bf16": Case(
        transparency_bf16,
        "every schedule x mode in bf16: error vs fp32 no worse than plain bf16",
        120.0,
    ),
    "fp16-scaler": Case(fp16_scaler, "fp16 with a gradient scaler: steps, skips and scales", 90.0),
    "front-door": Case(front_door, "y = pipe(x); loss.backward() equals the plain model", 60.0),
    "host-sync": Case(gpu_sync.host_sync, "no host synchronisation inside a step", 90.0),
    "overlap": Case(gpu_perf.overlap, "copies between GPUs overlap compute", 60.0),
    "throughput": Case(gpu_speed.throughput, "samples/s against plain, torchgpipe, pippy", 180.0),
    "memory": Case(gpu_perf.memory, "allocator peak against pipe.predict's forecast", 120.0),
    "nccl": Case(gpu_dist.nccl, "DistributedPipe over NCCL equals the plain model", 240.0),
}
"""Every case, in the order a run takes them (correctness first: a short loan proves most)."""


def child(name: str, opts: Options, result: str, log: str, timeout: float) -> None:
    """Runs case ``name`` and writes its rows as JSON to ``result``, its output to ``log``. If
    it runs past ``timeout`` seconds, faulthandler prints every thread's stack into the log and
    ends the process: a hang is a failure with its stacks, not a stall."""
    os.setsid()  # a group of its own: the parent kills anything the case started with it
    # Output (warnings, tracebacks, the stacks) goes to a file the parent shows when the case
    # fails, not into the middle of the report.
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.enable(all_threads=True)  # a crash or the parent's SIGABRT prints the stacks
    faulthandler.dump_traceback_later(timeout, exit=True)
    if opts.dry:  # OpenMP threads spinning on shared cores make tiny CPU steps 10-60x slower
        torch.set_num_threads(1)
    try:
        section = CASES[name].run(opts)
        payload: dict[str, object] = {"rows": section.rows, "notes": section.notes}
    except BaseException:  # noqa: BLE001 - reported in the case's table
        payload = {"error": traceback.format_exc()}
        print(payload["error"], file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    tmp = Path(result + ".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(result)
