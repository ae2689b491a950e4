"""What every case of the GPU check (benchmarks/gpu_check.py) shares: the run's options, the
rows a case reports, where its stages go, the model it pipelines and the plain step a pipeline
must equal.

The model carries what makes a pipeline hard to get right: a tuple input whose integer mask
rides along between stages, BatchNorm (deferred: running statistics once per mini-batch) and
dropout (seeded per micro-batch by the engine, see giantpipe.engine.rng)::

    (x, mask) -> Embed -> Block x n -> Head -> logits        Block: h + drop(relu(bn(fc(h)))) * mask

The reference is the plain model run micro-batch by micro-batch (gradient accumulation), each
run of layers on its own device under the dropout seeds the engine gives it::

    ref = plain_step(model, inputs, target, chunks=4, segments=[(len(model), device)])
    errs = errors(pipe_step(pipe, inputs, target), ref)   # relative error per tensor, by name
"""

from __future__ import annotations

import copy
import math
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from giantpipe.engine.rng import draw_step_seed, install_rng_hooks, rng_context
from giantpipe.engine.schedules import build_schedule, schedule_builders

SEED = 7  # torch.manual_seed before every pipelined step: the step's dropout seed follows
MODES = ("always", "except_last", "never")  # the re-materialization modes (recompute=)
FP32_TOL = 1e-5  # relative error of any tensor, pipelined against plain, fp32
LOW_PRECISION_FACTOR = 1.5  # bf16/fp16: the pipe's error vs fp32 at most 1.5x the plain model's
FP32_CRITERION = f"every tensor within {FP32_TOL:.0e} relative of the plain model's"
LOW_CRITERION = f"error vs fp32 <= {LOW_PRECISION_FACTOR}x the plain model's, every tensor"

Row = tuple[str, str, str, str]  # check, verdict, measured, criterion
PASS, FAIL, INFO, CUDA_ONLY, TWO_GPUS = "pass", "FAIL", "info", "CUDA only", "needs 2 GPUs"


@dataclass(frozen=True)
class Options:
    """One run of the check, as every case child sees it."""

    dry: bool  # CPU stand-ins and tiny sizes
    quick: bool  # the short budget (fewer rounds, smaller models)
    gpus: int  # CUDA devices visible to the run (0 in a dry run)
    inject: str | None = None  # test-only fault: "hang" stalls a stage, "wrong" perturbs a weight

    @property
    def workers(self) -> int:
        """K: 2 (on one GPU both share it), 4 when four GPUs are there."""
        return 4 if self.gpus >= 4 else 2

    def devices(self, k: int | None = None) -> list[torch.device]:
        """One device per worker: CPU stand-ins, or the GPUs in turn (shared when too few)."""
        k = self.workers if k is None else k
        if self.dry:
            return [torch.device("cpu")] * k
        return [torch.device("cuda", w % self.gpus) for w in range(k)]

    @property
    def device(self) -> torch.device:
        """Where the plain model runs: the first worker's device."""
        return self.devices(1)[0]


@dataclass
class Section:
    """What a case reports: rows of a markdown table, and notes under it."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, check: str, verdict: str | bool, measured: str, criterion: str) -> None:
        """One row; a bool verdict is pass/FAIL."""
        if isinstance(verdict, bool):
            verdict = PASS if verdict else FAIL
        self.rows.append((check, verdict, measured, criterion))


# ---- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """The mask model's sizes and the batch a case feeds it."""

    d_in: int
    width: int
    blocks: int
    batch: int
    classes: int

    @classmethod
    def of(cls, opts: Options) -> Sizes:
        if opts.dry:
            return cls(d_in=6, width=16, blocks=6, batch=16, classes=3)
        return cls(d_in=64, width=512, blocks=6, batch=256, classes=10)


class Embed(nn.Module):
    """(features, mask) -> (hidden, mask): the integer mask rides along."""

    def __init__(self, d_in: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, width)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, mask = batch
        return self.proj(x), mask


class Block(nn.Module):
    """A residual block with BatchNorm and dropout, masked by the carried integer mask.

    Dropout draws its mask for an fp32 tensor even under autocast: a mask depends on the dtype
    it is drawn for, and the bf16/fp16 runs are judged against an fp32 run with the same masks.
    The linear layer has no bias: BatchNorm would cancel it, leaving a gradient of float noise
    whose relative error says nothing.
    """

    def __init__(self, width: int, p: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(p)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h, mask = batch
        update = self.drop(torch.relu(self.bn(self.fc(h))).float())
        return h + update * mask.unsqueeze(-1), mask


class Head(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(batch[0])


def mask_model(sizes: Sizes) -> nn.Sequential:
    """Embed, ``sizes.blocks`` blocks and a head: ``blocks + 2`` layers to cut into stages."""
    torch.manual_seed(0)
    blocks = [Block(sizes.width) for _ in range(sizes.blocks)]
    return nn.Sequential(Embed(sizes.d_in, sizes.width), *blocks, Head(sizes.width, sizes.classes))


def mask_batch(sizes: Sizes) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((features, int64 mask), class targets), on the host."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sizes.batch, sizes.d_in, generator=g)
    mask = torch.randint(0, 2, (sizes.batch,), generator=g)
    return (x, mask), torch.randint(0, sizes.classes, (sizes.batch,), generator=g)


def to(batch: Any, device: torch.device) -> Any:
    """A tensor or a tuple of tensors on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return tuple(to(t, device) for t in batch)


def even_balance(layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible, the larger stages first."""
    return [layers // stages + (s < layers % stages) for s in range(stages)]


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


def step_seed() -> int:
    """The dropout seed a pipelined step draws right after ``torch.manual_seed(SEED)``."""
    torch.manual_seed(SEED)
    return draw_step_seed()


def autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """Autocast to ``dtype`` on ``device``'s type, or nothing for fp32."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


# ---- a pipe, and the faults a test injects ----------------------------------------------------


def build_pipe(model: nn.Sequential, opts: Options, balance: list[int], **kwargs: Any) -> GPipe:
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


def pipe_for(model: nn.Sequential, opts: Options, schedule: str, mode: str) -> GPipe:
    """K = ``opts.workers`` workers, M = 2K, ``schedule`` with the V it takes, even stages."""
    k, chunks = opts.workers, 2 * opts.workers
    v = virtual_stages(schedule, k, chunks)
    balance = even_balance(len(model), k * v)
    return build_pipe(
        model, opts, balance, chunks=chunks, recompute=mode, schedule=schedule, virtual_stages=v
    )


def attempt(section: Section, check: str, criterion: str, run: Callable[[], None]) -> None:
    """Runs ``run`` (which adds its own rows); if it raises, one FAIL row naming the exception
    (its traceback goes to the case's log): one broken configuration hides no other's rows."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        traceback.print_exc()
        first = str(exc).splitlines()[0][:100] if str(exc) else ""
        section.add(check, False, f"raised {type(exc).__name__}: {first}", criterion)


def _stall(module: nn.Module, args: Any) -> None:
    threading.Event().wait()  # forever: the case's timeout must catch it and dump the stacks


# ---- the step, pipelined and plain -------------------------------------------------------------


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
    plain = copy.deepcopy(model)
    convert_deferred_batch_norm(plain)
    hooks = install_rng_hooks(plain)
    parts, start = [], 0
    for count, device in segments:
        parts.append((plain[start : start + count].to(device), device))
        start += count
    seed = step_seed()
    total = float(target.shape[0])
    loss_sum = torch.zeros(())
    for m, (x, y) in enumerate(zip(_split(inputs, chunks), target.tensor_split(chunks))):
        with autocast(parts[-1][1], dtype):
            out = _run_parts(parts, x, seed, m)
            loss = nn.functional.cross_entropy(out, y.to(out.device)) * (y.shape[0] / total)
        loss.backward()
        loss_sum += loss.detach().float().cpu()
    commit_deferred_batch_norm(plain)
    for h in hooks:
        h.remove()
    plain.eval()
    with torch.no_grad(), autocast(parts[-1][1], dtype):
        outputs = _run_parts(parts, inputs, seed, 0)
    return _snapshot(plain, loss_sum, outputs)


def _split(inputs: tuple[torch.Tensor, ...], chunks: int) -> list[tuple[torch.Tensor, ...]]:
    # the engine's split: sizes as even as possible, larger first (torch.tensor_split's)
    return list(zip(*(t.tensor_split(chunks) for t in inputs)))


def _run_parts(parts: Sequence[tuple[nn.Module, torch.device]], x: Any, seed: int, m: int) -> Any:
    for part, device in parts:
        with rng_context(seed, m, device):
            x = part(to(x, device))
    return x


# ---- errors ------------------------------------------------------------------------------------


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (integer tensors: 0 if equal, else 1); a NaN is infinitely
    wrong (a NaN would compare as neither larger nor smaller than a tolerance).

    >>> relative(torch.tensor([1.0, float("nan")]), torch.ones(2))
    inf
    """
    if not b.is_floating_point():
        return 0.0 if torch.equal(a.cpu(), b.cpu()) else 1.0
    a64, b64 = a.double().cpu(), b.double().cpu()
    value = float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))
    return math.inf if math.isnan(value) else value


def errors(got: Outcome, ref: Outcome) -> dict[str, float]:
    """The relative error of every tensor of ``got`` against ``ref``, by name (``loss``,
    ``grad:<param>``, ``buffer:<name>``, ``outputs``); a missing gradient counts as 1."""
    out = {"loss": relative(got.loss, ref.loss)}
    for name, g in ref.grads.items():
        out[f"grad:{name}"] = relative(got.grads[name], g) if name in got.grads else 1.0
    for name, b in ref.buffers.items():
        out[f"buffer:{name}"] = relative(got.buffers[name], b) if name in got.buffers else 1.0
    if ref.outputs is not None:
        out["outputs"] = relative(got.outputs, ref.outputs) if got.outputs is not None else 1.0
    return out


def worst(errs: dict[str, float]) -> tuple[str, float]:
    """The name and value of the largest error."""
    name = max(errs, key=lambda n: errs[n])
    return name, errs[name]


def worst_ratio(pipe: dict[str, float], plain: dict[str, float]) -> tuple[str, float]:
    """The tensor whose pipelined error (against fp32) exceeds the plain model's the most,
    as the smallest factor F with pipe <= F * plain + 1e-6."""
    ratios = {
        n: (e - 1e-6) / plain[n] if plain[n] > 0 else (0.0 if e <= 1e-6 else float("inf"))
        for n, e in pipe.items()
    }
    return worst(ratios)


@contextmanager
def closing(pipe: GPipe) -> Iterator[GPipe]:
    """Stops the pipe's worker threads at the end (a case builds many pipes)."""
    try:
        yield pipe
    finally:
        pipe.close()
