"""The tests' fork server: one process per test session that imported torch, the runner, Hydra
and matplotlib once, from which ranks and ``train.py`` runs start as processes of their own.

A fresh interpreter spends seconds of CPU importing what every run imports (torch, dynamo, the
runner, Hydra, matplotlib): a two-step MLP run took 3.5 s of CPU fresh, 0.7 s forked. A forked
script gets the environment (its thread count too), working folder and ``sys.argv`` it was given,
runs as ``__main__``, and exits as the interpreter would (non-daemon threads joined, ``atexit``
run, a ``SystemExit``'s code, or an uncaught exception's traceback and 1).

What a fork cannot show needs a fresh interpreter (:func:`forkable` says which): what a command
imports (``-X importtime``), a script of another checkout, a ``PYTHONPATH`` of its own.

Example::

    done = run_script(REPO / "train.py", ["trainer.max_steps=2"], cwd=tmp, env=dict(os.environ),
                      timeout=120)
    assert done.returncode == 0, done.stderr
"""

from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing.context import ForkServerContext
from pathlib import Path

from tests.timeouts import scaled, timed_out

REPO = Path(__file__).resolve().parents[2]

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # the pre-flight's first meta op imports it (~0.8 s with sympy)
    "tests.support.forks",
    "tests.support.ranks",
    "giantpipe.engine.distributed.pipe",
    "giantpipe.cli",
    "giantpipe.runner",
    "giantpipe.testing.reference",
    "hydra",
    "omegaconf",
    "matplotlib.pyplot",  # a run's closing pictures (~0.5 s)
    "matplotlib.backends.backend_agg",
]
"""What the server imports before it forks anything."""


def context() -> ForkServerContext:
    """The fork server's context (started, with :data:`PRELOAD`, by its first process)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def forkable(script: Path, env: dict[str, str] | None) -> bool:
    """Whether a fork shows what a fresh ``python SCRIPT`` would: a script of this checkout, whose
    ``giantpipe`` the server imports (not another checkout's, as an editable install of one
    venv shared by several worktrees may give), with no ``PYTHONPATH`` of its own."""
    spec = importlib.util.find_spec("giantpipe")
    ours = spec is not None and Path(str(spec.origin)).resolve().is_relative_to(REPO)
    return ours and script.resolve().is_relative_to(REPO) and "PYTHONPATH" not in (env or {})


def exit_status(code: object) -> int:
    """The status the interpreter exits with for ``SystemExit(code)``: None 0, an int itself,
    anything else printed to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def print_from(script: str, exc: BaseException) -> None:
    """Prints ``exc``'s traceback as ``python SCRIPT`` would: from the script's first frame on
    (none of runpy's or this module's)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def _as_main(script: str) -> int:
    """Runs ``script`` as ``__main__`` and shuts down as the interpreter would; its status."""
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = exit_status(stop.code)
    except BaseException as exc:  # noqa: BLE001 - what the interpreter does with an uncaught one
        print_from(script, exc)
        status = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # a forked child ends in os._exit, which skips them
    return status


def _script_child(
    script: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str
) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # read when the server loaded OpenMP, not now
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    # as `python SCRIPT` builds it: the script's folder, then PYTHONPATH's, then the rest
    first = [str(Path(script).parent), *env.get("PYTHONPATH", "").split(os.pathsep)]
    first = [p for p in dict.fromkeys(first) if p]
    sys.path[:] = first + [p for p in sys.path if p not in first and p]
    status = _as_main(script)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_script(
    script: Path, args: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` in ``cwd`` with environment ``env``, forked from the server, to its
    end, its output captured as ``subprocess.run(..., capture_output=True, text=True)`` would;
    fails, saying so, after ``scaled(timeout)`` s (the process killed)."""
    limit = scaled(timeout)
    command = [sys.executable, str(script), *args]
    with tempfile.TemporaryDirectory(prefix="giantpipe-fork-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        paths = (str(script), list(args), str(cwd), dict(env), str(out), str(err))
        proc = context().Process(target=_script_child, args=paths)
        proc.start()
        proc.join(limit)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise AssertionError(timed_out(" ".join(command[:3]), limit))
        # text=True's universal newlines: a progress bar's "\r" reads as a line end too
        stdout = out.read_text(errors="replace") if out.exists() else ""
        stderr = err.read_text(errors="replace") if err.exists() else ""
    assert proc.exitcode is not None  # joined
    return subprocess.CompletedProcess(command, proc.exitcode, stdout, stderr)


def forked_cpu(tasks: Path = Path("/proc/self/task")) -> float:
    """CPU seconds of the processes this process's fork server has forked and seen end (the
    server reaps them, so they are not this process's waited-for children); 0 without one.
    ``tasks``: this process's threads, each listing its children."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for children in tasks.glob("*/children"):
        try:
            pids = children.read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:  # it ended meanwhile
                continue
            # after the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
            fields = stat.rpartition(")")[2].split()
            if b"forkserver" in cmdline:
                total += (int(fields[13]) + int(fields[14])) / tick
    return total
