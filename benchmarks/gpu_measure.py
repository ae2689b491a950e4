"""The GPU check's measurements, and how one runs: in a child process with a timeout.

Speed and memory are measured, not tested: each measurement prints a table of rows (check,
verdict, measured, criterion), its values judged by the bands a GPU run set from its data
(gpu_bands.py; "no band yet" until one did), on the GPUs of the run or on CPU stand-ins, where
what cannot be judged says so. The copy/compute overlap and memory are
gpu_perf.py's, the throughput gpu_speed.py's. The GPU tests (tests/gpu, pytest) prove the
engine right; these say how fast and how big.

Example (what the child runs)::

    section = MEASUREMENTS["memory"].run(GpuOptions(dry=True, quick=True, gpus=0))
    section.rows[0]   # ('recompute never: measured/forecast', 'no band yet', '1.00 (...)', '-')
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext
from pathlib import Path

import gpu_perf
import gpu_speed
import torch
from gpu_common import CaseResult, Section

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
    "memory": Measurement(
        gpu_perf.memory, "allocator peak against predict(pipe, ...)'s forecast", 120.0
    ),
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
        payload: dict[str, object] = {
            "rows": section.rows,
            "notes": section.notes,
            "measured": section.measured,
        }
    except BaseException:  # noqa: BLE001 - reported in the case's table
        payload = {"error": traceback.format_exc()}
        print(payload["error"], file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    tmp = Path(result + ".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(result)


GRACE_S = 20.0  # past a case's timeout before the parent aborts it (faulthandler should have)


def _context() -> ForkServerContext:
    # Children fork from a server that has imported torch and the measurements once (a fresh
    # interpreter costs seconds per case on a busy CPU) and touched no CUDA (a forked CUDA
    # runtime is unusable): each case still starts its own CUDA context.
    ctx = mp.get_context("forkserver")
    assert isinstance(ctx, ForkServerContext)
    ctx.set_forkserver_preload(["torch", "gpu_measure"])
    return ctx


def run_measurement(name: str, opts: GpuOptions, timeout: float) -> CaseResult:
    """Runs measurement ``name`` in a child with ``timeout`` seconds; on expiry the child dumps
    every thread's stack and exits (if it cannot, the parent aborts it, then kills its group)."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        result, log = Path(tmp, "result.json"), Path(tmp, "log.txt")
        started = time.perf_counter()
        args = (name, opts, str(result), str(log), timeout)
        proc = _context().Process(target=child, args=args)
        proc.start()
        pid = proc.pid
        assert pid is not None
        proc.join(timeout + GRACE_S)
        if proc.is_alive():  # faulthandler did not end it: SIGABRT makes it print the stacks
            _signal(pid, signal.SIGABRT)
            proc.join(10)
        kill_group(pid)  # ranks or workers the case left behind
        proc.join(5)
        seconds = time.perf_counter() - started
        text = log.read_text(errors="replace") if log.exists() else ""
        return _outcome(name, seconds, result, text, proc.exitcode, timeout)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_group(pid: int) -> None:
    """Kills process group ``pid`` (a case and whatever it started), if any is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _outcome(
    name: str, seconds: float, result: Path, log: str, code: int | None, timeout: float
) -> CaseResult:
    """The measurement's rows, or why there are none."""
    out = CaseResult(name, seconds, log=log)
    if result.exists():
        data = json.loads(result.read_text())
        if "error" in data:
            out.problem, out.log = "raised an exception", data["error"]
        else:
            out.rows, out.notes, out.measured = data["rows"], data["notes"], data["measured"]
    elif "Timeout (" in log or code is None or seconds >= timeout:
        out.problem = f"timed out after {timeout:.0f} s"
    else:
        out.problem = f"crashed (exit {code})"
    return out
