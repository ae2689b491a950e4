"""Start a small gloo world on loopback for a test: spawn processes, or torchrun commands.

Every launch has a deadline; on expiry (or when the test is done) every process it started is
killed, so a failing test never leaves workers behind.

Example::

    results = spawn("tests.distributed.workers:equivalence", world=2, tmp=tmp_path, chunks=[1, 3])
    assert results[0]["checked"] > 0
"""

from __future__ import annotations

import datetime
import importlib
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from giantpipe.testing import free_port, rank_env
from tests.timeouts import scaled, timed_out

REPO = Path(__file__).resolve().parents[2]


# Ranks fork from one server process that has imported torch and the workers once per test
# session: a spawned rank imports torch again, seconds of CPU each on a 2-core machine. Each rank
# still gets the launching process's environment and working directory as they are at launch.
PRELOAD = ["torch", "torch.distributed", "tests.distributed.launch", "tests.distributed.workers"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(
    target: str,
    rank: int,
    world: int,
    port: int,
    tmp: str,
    kwargs: dict,
    env: dict,
    cwd: str,
    backend: str = "gloo",
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    out = Path(tmp) / f"result-{rank}.pt"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=scaled(30)))
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(Path(tmp), **kwargs)
        torch.save({"ok": True, "result": result}, out)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # do not wait for peers that may be stuck


def spawn(
    target: str,
    world: int,
    tmp: Path,
    timeout: float = 90.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Runs ``target(tmp, **kwargs)`` on ``world`` gloo ranks; returns each rank's result.

    ``backend`` is the world's (``init_process_group``'s): e.g. ``"cuda:gloo"`` makes a world
    that takes no CPU tensor, as an NCCL world would not. Raises AssertionError with the
    worker's traceback when a rank failed.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = _context()
    port = free_port()
    here = (dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(target=_entry, args=(target, r, world, port, str(tmp), kwargs, *here, backend))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        if alive:
            raise TimeoutError(timed_out(f"ranks {alive} of {target}", timeout))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for r in range(world):
        path = tmp / f"result-{r}.pt"
        if not path.exists():
            raise AssertionError(f"rank {r} exited with {procs[r].exitcode} and no result")
        data = torch.load(path, weights_only=False)
        if not data["ok"]:
            raise AssertionError(f"rank {r} failed:\n{data['error']}")
        results.append(data["result"])
    return results


def start_processes(world: int, target: str, tmp: Path, **kwargs: Any) -> list[Any]:
    """Starts ranks without waiting (fault tests watch them exit); returns the processes."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = _context()
    port = free_port()
    here = (dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(target=_entry, args=(target, r, world, port, str(tmp), kwargs, *here))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def torchrun(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m torch.distributed.run ARGS`` in its own process group, output captured."""
    full_env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}:{REPO}", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: killable as a whole
    )


def train_under_torchrun(
    run_dir: Path, *overrides: str, timeout: int = 60, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``torchrun --nproc_per_node=2 train.py OVERRIDES pipeline.executor=distributed`` into
    ``run_dir``, on a free loopback port (see :func:`torchrun`)."""
    return torchrun(
        [
            "--nproc_per_node=2",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            "--max_restarts=0",
            str(REPO / "train.py"),
            *overrides,
            "pipeline.executor=distributed",
            f"pipeline.timeout={scaled(timeout):g}",
            f"hydra.run.dir={run_dir}",
        ],
        env=env,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """Waits for a torchrun launch; kills its whole process group on timeout."""
    timeout = scaled(timeout)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"{timed_out('the torchrun launch', timeout)}:\n{out}") from None
