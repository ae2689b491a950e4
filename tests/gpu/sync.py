"""Recorders of host synchronisation: what a step did that would make the host wait for a GPU.

A synchronising call (``.item()``, a copy to the host, ``nonzero``, ...) inside a step stalls
the worker that makes it until its GPU has run everything queued, and with it the pipeline's
fill. On CUDA, :func:`cuda_syncs` records every synchronising call of any thread under
``torch.cuda.set_sync_debug_mode('warn')``, with its place; on CPU stand-ins nothing is a
synchronisation, so :func:`host_reads` lists the host reads (what would be one on a GPU).

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


@dataclass(frozen=True)
class SyncPoint:
    """A synchronising call seen during a step: what, and where (the innermost giantpipe
    frame if there is one, else the innermost caller outside torch)."""

    what: str
    where: str


def where_called() -> str:
    """file:line of the frame that made the call being recorded."""
    mine = (__file__, "warnings.py")  # the recorder's own frames and the warning machinery
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
