"""The GPU check's copy and memory measurements: copies between GPUs overlapping compute, and
the allocator's peak against the forecast (throughput is gpu_speed.py's), with the MLP they
share.

Each runs on the GPUs of the run (K=2; on one GPU both stages share it, each on its own
stream), or on CPU stand-ins in a dry run, where what cannot be judged without CUDA says so.
Their values are judged by bands a GPU run set (gpu_bands.py), not by limits chosen here.

Example::

    section = memory(GpuOptions(dry=True, quick=True, gpus=0))
"""

from __future__ import annotations

from contextlib import closing, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from gpu_common import FAIL, INFO, Section, attempt
from torch import nn

from giantpipe import GPipe
from giantpipe.perf.balance import even_balance
from giantpipe.perf.predict import predict
from giantpipe.testing.gpu import TWO_GPUS, GpuOptions

MEMORY_CRITERION = "allocator peak growth / forecast activations, per device"


@dataclass(frozen=True)
class MLP:
    """The MLP of the overlap, throughput and memory cases: ``blocks`` x (Linear(width) + ReLU),
    ``rounds`` x ``steps`` timed steps per method."""

    width: int
    blocks: int
    batch: int
    chunks: int
    rounds: int
    steps: int

    @classmethod
    def of(cls, opts: GpuOptions) -> MLP:
        if opts.dry:
            return cls(width=64, blocks=4, batch=64, chunks=4, rounds=2, steps=2)
        if opts.quick:
            return cls(width=2048, blocks=8, batch=512, chunks=8, rounds=3, steps=5)
        return cls(width=4096, blocks=8, batch=1024, chunks=8, rounds=5, steps=10)

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        layers = [
            nn.Sequential(nn.Linear(self.width, self.width), nn.ReLU()) for _ in range(self.blocks)
        ]
        return nn.Sequential(*layers)

    def batch_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(self.batch, self.width, generator=g)
        return x.to(device), torch.randn(self.batch, self.width, generator=g).to(device)


def sync(devices: list[torch.device]) -> None:
    """Waits for every CUDA device of ``devices`` (timing and memory reads)."""
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


# ---- copy / compute overlap --------------------------------------------------------------------

Interval = tuple[float, float]


def covered(intervals: list[Interval], by: list[Interval]) -> float:
    """The fraction of the total length of ``intervals`` that lies inside the union of ``by``.

    >>> covered([(0, 10)], [(2, 4), (3, 6), (8, 20)])
    0.6
    """
    union: list[list[float]] = []
    for start, end in sorted(by):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    total = sum(end - start for start, end in intervals)
    inside = sum(
        max(0.0, min(end, u_end) - max(start, u_start))
        for start, end in intervals
        for u_start, u_end in union
    )
    return inside / total if total > 0 else 0.0


def device_activity(prof: Any) -> dict[int, tuple[list[Interval], list[Interval]]]:
    """Per CUDA device, from a profiler trace: (copy intervals, compute kernel intervals), µs."""
    from torch.autograd import DeviceType

    out: dict[int, tuple[list[Interval], list[Interval]]] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        copies, kernels = out.setdefault(int(e.device_index), ([], []))
        span = (float(e.time_range.start), float(e.time_range.end))
        if e.name.startswith("Memcpy"):
            copies.append(span)
        elif not e.name.startswith("Memset"):
            kernels.append(span)
    return out


def profiled_step(opts: GpuOptions) -> tuple[Any, Any]:
    """K=2 on the run's devices (two GPUs: one each), two steps to warm up, then one step under
    the profiler when there are two GPUs to see; returns (its statistics, the profile)."""
    mlp = MLP.of(opts)
    devices = opts.devices(2)
    pipe = GPipe(mlp.model(), even_balance(mlp.blocks, 2), devices=devices, chunks=mlp.chunks,
                 recompute="never")  # fmt: skip
    x, _ = mlp.batch_on(devices[0])
    y = torch.zeros_like(x, device=devices[-1])
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    profiler = torch.profiler.profile(activities=activities) if opts.gpus >= 2 else nullcontext()
    with closing(pipe):
        for _ in range(2):
            pipe.train_step(x, y, nn.functional.mse_loss)
        sync(devices)
        with profiler as prof:
            pipe.train_step(x, y, nn.functional.mse_loss)
            sync(devices)
        return pipe.last_stats, prof


def overlap(opts: GpuOptions) -> Section:
    """The fraction of the time of the copies between two GPUs during which their GPU also
    computes. Stages sharing one GPU hand values over without a copy, so one GPU (or CPU
    stand-ins) proves nothing about it; how much the stages overlap is printed anyway."""
    section = Section()
    stats, prof = profiled_step(opts)
    ratio = sum(stats.busy_time_s) / stats.span_s if stats.span_s > 0 else 0.0
    section.add("stages at work at once (sum of busy / span)", INFO, f"{ratio:.2f}",
                f"1 = no overlap, 2 = both stages busy throughout ({stats.clock})")  # fmt: skip
    check = "copies between GPUs under compute"
    if opts.gpus < 2:
        why = "not provable on one GPU" if opts.gpus == 1 else "CPU stand-ins: no copies"
        section.add(check, TWO_GPUS, why, "the copies' time that overlaps a kernel on their GPU")
        return section
    activity = device_activity(prof)
    copies = [c for cs, _ in activity.values() for c in cs]
    if not copies:
        section.add(check, FAIL, "the profiler recorded no copy on any GPU", "-")
        return section
    fraction = sum(covered(cs, ks) * _length(cs) for cs, ks in activity.values()) / _length(copies)
    section.banded(check, [fraction], f"{fraction:.0%} of {len(copies)} copies' time", "floor")
    return section


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


# ---- memory --------------------------------------------------------------------------------------


def step_peaks(pipe: GPipe, x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """Per CUDA device of the pipe (in worker order, each once), the allocator's peak over one
    step above what was allocated when it began; CPU stand-ins: the saved activations per
    worker (the step's own meter)."""
    devices = list(dict.fromkeys(pipe.worker_devices))
    if devices[0].type != "cuda":
        pipe.train_step(x, y, nn.functional.mse_loss)
        assert pipe.last_stats is not None
        return list(pipe.last_stats.peak_memory_bytes)
    sync(devices)
    base = {}
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
        base[d] = torch.cuda.memory_allocated(d)
    pipe.train_step(x, y, nn.functional.mse_loss)
    sync(devices)
    return [torch.cuda.max_memory_allocated(d) - base[d] for d in devices]


def memory_row(section: Section, opts: GpuOptions, mode: str, shared: bool) -> None:
    """One mode's step: measured peak(s) against the forecast activations."""
    mlp = MLP.of(opts)
    devices = opts.devices(2)
    pipe = GPipe(mlp.model(), even_balance(mlp.blocks, 2), devices=devices, chunks=mlp.chunks,
                 recompute=mode)  # fmt: skip
    x, y = mlp.batch_on(devices[0])
    y = y.to(devices[-1])
    with closing(pipe):
        pipe.train_step(x, y, nn.functional.mse_loss)  # gradients allocated before the peak
        forecast = predict(pipe, x, y, nn.functional.mse_loss).simulation.peak_activation_bytes
        measured = step_peaks(pipe, x, y)
    if shared:
        forecast = [sum(forecast)]
    ratios = [m / f if f else float("inf") for m, f in zip(measured, forecast)]
    mib = ", ".join(f"{m / 2**20:.1f}/{f / 2**20:.1f} MiB" for m, f in zip(measured, forecast))
    shown = f"{', '.join(f'{r:.2f}' for r in ratios)} ({mib})"
    section.banded(f"recompute {mode}: measured/forecast", ratios, shown, "both")


def memory(opts: GpuOptions) -> Section:
    """The allocator's peak over a step against ``predict(pipe, ...)``'s forecast of the activations
    (per GPU; on one GPU the workers' forecasts summed), for two re-materialization modes."""
    devices = opts.devices(2)
    shared = not opts.dry and len(set(devices)) < len(devices)  # one allocator for both
    section = Section()
    for mode in ("never", "except_last"):
        attempt(section, f"recompute {mode}: measured/forecast", MEMORY_CRITERION,
                partial(memory_row, section, opts, mode, shared))  # fmt: skip
    if opts.dry:
        what = "saved activations per worker (the engine's meter)"
    else:
        what = "allocator peak over the step's start" + (", both stages on one GPU" * shared)
    mlp = MLP.of(opts)
    section.notes.append(f"measured: {what}; forecast: predict(pipe, ...).simulation"
                         f".peak_activation_bytes; M={mlp.chunks}, batch {mlp.batch}.")  # fmt: skip
    return section
