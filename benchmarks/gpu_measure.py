"""The GPU check's measurements, and the child process that runs one (benchmarks/gpu_check.py).

Speed and memory are measured, not tested: each measurement prints a table of rows (check,
verdict, measured, criterion) against the team's acceptance criteria, on the GPUs of the run or
on CPU stand-ins, where what cannot be judged says so. The copy/compute overlap and memory are
gpu_perf.py's, the throughput gpu_speed.py's. The GPU tests (tests/gpu, pytest) prove the
engine right; these say how fast and how big.

Example (what the child runs)::

    section = MEASUREMENTS["memory"].run(GpuOptions(dry=True, quick=True, gpus=0))
    section.rows[0]   # ('recompute never: measured/forecast', 'pass', '1.00 (...)', ...)
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_perf
import gpu_speed
import torch
from gpu_common import Section

from giantpipe.testing.gpu import GpuOptions


@dataclass(frozen=True)
class Measurement:
    """A measurement: what runs, what it measures (one line) and its timeout on a GPU, seconds
    (a ceiling, several times what it should take: reached only by a hang)."""

    run: Callable[[GpuOptions], Section]
    proves: str
    timeout: float


MEASUREMENTS: dict[str, Measurement] = {
    "overlap": Measurement(gpu_perf.overlap, "copies between GPUs overlap compute", 60.0),
    "throughput": Measurement(
        gpu_speed.throughput, "samples/s against plain, torchgpipe, pippy", 180.0
    ),
    "memory": Measurement(gpu_perf.memory, "allocator peak against pipe.predict's forecast", 120.0),
}
"""Every measurement, in the order a run takes them."""


def child(name: str, opts: GpuOptions, result: str, log: str, timeout: float) -> None:
    """Runs measurement ``name`` and writes its rows as JSON to ``result``, its output to
    ``log``. If it runs past ``timeout`` seconds, faulthandler prints every thread's stack into
    the log and ends the process: a hang is a failure with its stacks, not a stall."""
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
        section = MEASUREMENTS[name].run(opts)
        payload: dict[str, object] = {"rows": section.rows, "notes": section.notes}
    except BaseException:  # noqa: BLE001 - reported in the case's table
        payload = {"error": traceback.format_exc()}
        print(payload["error"], file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    tmp = Path(result + ".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(result)
