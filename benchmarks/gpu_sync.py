"""The GPU check's host-synchronisation case: a step must never wait for the GPU.

A synchronising call (``.item()``, a copy to the host, ``nonzero``, ...) inside a step stalls
the worker that makes it until its GPU has run everything queued, and with it the pipeline's
fill. On CUDA every way of stepping a pipe runs once under ``torch.cuda.set_sync_debug_mode
('warn')``, any thread's synchronising call recorded with its stack; on CPU stand-ins nothing is
a synchronisation, so the host reads are listed (what would be one on a GPU), not judged.

Example::

    with cuda_syncs() as seen:          # or host_reads() on CPU stand-ins
        pipe.train_step(x, y, loss_fn)
    summarise(seen)                     # 'none', or 'item() at src/giantpipe/...:80 x1; ...'
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from gpu_common import (
    CUDA_ONLY,
    SEED,
    Options,
    Section,
    Sizes,
    mask_batch,
    mask_model,
    pipe_for,
    schedules,
    to,
)
from torch import nn

from giantpipe import GPipe


@dataclass(frozen=True)
class SyncPoint:
    """A synchronising call seen during a step: what, and where (the innermost giantpipe
    frame if there is one, else the innermost caller outside torch)."""

    what: str
    where: str


def where_called() -> str:
    """file:line of the frame that made the call being recorded."""
    mine = ("gpu_sync.py", "warnings.py")  # the recorder's own frames and the warning machinery
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith(mine)]
    for frame in reversed(frames):
        if "/src/giantpipe/" in frame.filename:
            return "src/giantpipe/" + f"{frame.filename.split('/src/giantpipe/')[1]}:{frame.lineno}"
    outside = [f for f in frames if "/torch/" not in f.filename] or frames
    return f"{Path(outside[-1].filename).name}:{outside[-1].lineno}"


@contextmanager
def cuda_syncs() -> Iterator[list[SyncPoint]]:
    """Records every synchronising CUDA call (``torch.cuda.set_sync_debug_mode('warn')``)
    made by any thread, with the Python stack of the thread that made it."""
    seen: list[SyncPoint] = []

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:  # fmt: skip
        if "synchroniz" in str(message):  # "called a synchronizing CUDA operation"
            seen.append(SyncPoint(str(message).split("\n")[0][:60], where_called()))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # restored by catch_warnings; every thread warns through it
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")


READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
"""Tensor methods that read a value back to the host: a sync when the tensor is on a GPU."""


@contextmanager
def host_reads() -> Iterator[list[SyncPoint]]:
    """Records every call of :data:`READS` on any tensor, by any thread (CPU stand-ins: these
    would be synchronisations if the tensor lived on a GPU; on the host they are not)."""
    seen: list[SyncPoint] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in READS}

    def recording(name: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, name)

        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.append(SyncPoint(f"{name}()", where_called()))
            return original(self, *args, **kwargs)

        return call

    for name in READS:
        setattr(torch.Tensor, name, recording(name))
    try:
        yield seen
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def summarise(points: list[SyncPoint]) -> str:
    """``what at where xN`` per distinct point, most frequent first; "none" if empty."""
    counts: dict[SyncPoint, int] = {}
    for p in points:
        counts[p] = counts.get(p, 0) + 1
    shown = sorted(counts.items(), key=lambda kv: -kv[1])
    return "; ".join(f"{p.what} at {p.where} x{n}" for p, n in shown) or "none"


def sync_steps(opts: Options) -> dict[str, Callable[[], Any]]:
    """One step function per way of stepping a pipe: train_step under every schedule, the
    front door, and (when the engine has it) an fp16 step with a gradient scaler."""
    model, (inputs, target) = mask_model(Sizes.of(opts)), mask_batch(Sizes.of(opts))
    steps: dict[str, Callable[[], Any]] = {}
    for schedule in schedules():
        pipe = pipe_for(model, opts, schedule, "except_last")
        x, y = to(inputs, pipe.devices[0]), target.to(pipe.devices[-1])
        steps[f"train_step {schedule}"] = _train(pipe, x, y)
    door = pipe_for(model, opts, "gpipe", "except_last")
    x, y = to(inputs, door.devices[0]), target.to(door.devices[-1])  # zb-v ends on worker 0
    steps["front door (forward + backward)"] = _front_door(door, x, y)
    steps["train_step gpipe, fp16 + grad_scaler"] = _scaled(door, x, y)
    return steps


def _front_door(pipe: GPipe, x: Any, y: torch.Tensor) -> Callable[[], Any]:
    return lambda: nn.functional.cross_entropy(pipe(x), y).backward()


def _train(pipe: GPipe, x: Any, y: torch.Tensor) -> Callable[[], Any]:
    return lambda: pipe.train_step(x, y, nn.functional.cross_entropy)


def _scaled(pipe: GPipe, x: Any, y: torch.Tensor) -> Callable[[], Any]:
    scaler = pipe.grad_scaler()

    def step() -> Any:
        with torch.autocast(pipe.devices[-1].type, dtype=torch.float16):
            return pipe.train_step(x, y, nn.functional.cross_entropy, grad_scaler=scaler)

    return step


def host_sync(opts: Options) -> Section:
    """Every way of stepping a pipe, once to warm up, then once watched: on CUDA under
    ``set_sync_debug_mode('warn')`` (a synchronising call anywhere in the step fails it);
    on CPU stand-ins the host reads (``.item()``, ``.cpu()``, ...) are listed, not judged."""
    section = Section()
    criterion = "no synchronising CUDA call (sync debug mode 'warn')"
    for label, step in sync_steps(opts).items():
        torch.manual_seed(SEED)
        step()  # warm-up: first-use initialisations (handles, streams, events) may sync
        torch.manual_seed(SEED)
        with host_reads() if opts.dry else cuda_syncs() as seen:
            step()
        if opts.dry:
            section.add(label, CUDA_ONLY, "host reads: " + summarise(seen), criterion)
        else:
            section.add(label, not seen, summarise(seen), criterion)
    if opts.dry:
        section.notes.append(
            "CPU stand-ins: every tensor is on the host, so no call here is a synchronisation; "
            "the host reads listed would be one if their tensor lived on a GPU."
        )
    return section
