"""The one rank launcher of the tests: a world of ranks on loopback, spawned here or started
by torchrun; gloo, or NCCL on GPUs for the GPU tests (one GPU a rank).

Each rank gets its torchrun environment on a free port (:mod:`giantpipe.testing.world`), runs
``module:function(tmp, **kwargs)`` and leaves ``tmp/result-<rank>.pt``; a launch that outlives
its timeout (lengthened by tests/timeouts.py's knob) is killed and says so, and the first rank
to fail has its traceback reported.

Example::

    results = spawn("tests.distributed.workers:equivalence", world=2, tmp=tmp_path, chunks=[1, 3])
    code, out = finish(torchrun(["--standalone", "--nproc_per_node=2",
                                 *rank_script("tests.distributed.workers:faulty", tmp_path)]), 120)
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from giantpipe.engine.distributed.layout import end_distributed, init_distributed
from giantpipe.testing import free_port, rank_env
from tests.support.forks import context
from tests.timeouts import scaled, timed_out

REPO = Path(__file__).resolve().parents[2]

RENDEZVOUS_S = 30.0
"""The world's timeout (scaled): how long a rank waits for the others to join it, or in a
collective."""


def run_rank(target: str, tmp: Path, kwargs: dict[str, Any], backend: str | None = "gloo") -> None:
    """In a rank whose torchrun environment is set: joins the world (as the runner does: on a
    GPU machine this rank's GPU, ``cuda:LOCAL_RANK``, made current first; ``backend`` None:
    the runner's choice, NCCL for GPU tensors), runs ``target(tmp, **kwargs)`` and writes its
    result, or its traceback, exception and when it failed, to ``tmp/result-<rank>.pt``; a
    failure exits at once (peers may be stuck)."""
    torch.set_num_threads(1)
    out = tmp / f"result-{os.environ['RANK']}.pt"
    try:
        init_distributed(backend, timeout=scaled(RENDEZVOUS_S))
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(tmp, **kwargs)
        torch.save({"ok": True, "result": result}, out)
        end_distributed()  # every group freed before a torchrun rank's interpreter shuts down
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        what = f"{type(exc).__name__}: {exc}"
        torch.save(
            {"ok": False, "error": traceback.format_exc(), "what": what, "at": time.time()}, out
        )
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)


def _spawned(
    target: str, rank: int, world: int, port: int, tmp: str, kwargs: dict, env: dict, cwd: str,
    backend: str | None,
) -> None:  # fmt: skip
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(rank_env(rank, world, port))
    run_rank(target, Path(tmp), kwargs, backend)


def start_ranks(
    target: str, world: int, tmp: Path, backend: str | None = "gloo", **kwargs: Any
) -> list[BaseProcess]:
    """Starts ``world`` ranks running ``target(tmp, **kwargs)`` without waiting for them (a
    fault test watches them exit); returns the processes, rank by rank. ``backend`` is the
    world's, e.g. ``"cuda:gloo"`` for one that takes no CPU tensor, as an NCCL world would not,
    or None for the runner's (:func:`run_rank`): an NCCL world on GPUs, one GPU a rank."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = context()  # the imports done once (tests/support/forks.py)
    port = free_port()
    here = (dict(os.environ), os.getcwd(), backend)
    procs: list[BaseProcess] = [
        ctx.Process(target=_spawned, args=(target, r, world, port, str(tmp), kwargs, *here))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def rank_records(tmp: Path, world: int) -> dict[int, dict[str, Any]]:
    """What each rank that wrote one left in ``tmp``: ``{"ok": True, "result": ...}`` or
    ``{"ok": False, "error": traceback, "what": "Type: message", "at": when}``."""
    paths = {r: tmp / f"result-{r}.pt" for r in range(world)}
    return {r: torch.load(p, weights_only=False) for r, p in paths.items() if p.exists()}


def first_failure(records: dict[int, dict[str, Any]]) -> str | None:
    """The traceback of the rank that failed first (the others mostly fail because of it)."""
    failed = sorted((rec["at"], r) for r, rec in records.items() if not rec["ok"])
    if not failed:
        return None
    rank = failed[0][1]
    return f"rank {rank} failed first:\n{records[rank]['error']}"


def results_of(tmp: Path, world: int, exits: list[int | None] | None = None) -> list[Any]:
    """Every rank's result; fails with the first failing rank's traceback, or naming a rank
    that left none (with its exit code when ``exits`` gives it)."""
    records = rank_records(tmp, world)
    failure = first_failure(records)
    if failure is not None:
        raise AssertionError(failure)
    for r in range(world):
        if r not in records:
            code = "" if exits is None else f" exited with {exits[r]} and"
            raise AssertionError(f"rank {r}{code} left no result in {tmp}")
    return [records[r]["result"] for r in range(world)]


def stop_ranks(procs: list[BaseProcess], timeout: float) -> list[int]:
    """Waits for the ranks of :func:`start_ranks` until ``scaled(timeout)`` s from now (for the
    world, not for each rank in turn); kills those still running then and returns their
    ranks."""
    deadline = time.monotonic() + scaled(timeout)
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def spawn(
    target: str, world: int, tmp: Path, timeout: float = 90.0, backend: str | None = "gloo",
    **kwargs: Any,
) -> list[Any]:  # fmt: skip
    """Runs ``target(tmp, **kwargs)`` on ``world`` ranks (:func:`start_ranks`) and returns each
    rank's result; ranks still running after ``scaled(timeout)`` are killed and named."""
    procs = start_ranks(target, world, tmp, backend, **kwargs)
    late = stop_ranks(procs, timeout)
    if late:
        said = timed_out(f"ranks {late} of {target}", scaled(timeout))
        failure = first_failure(rank_records(tmp, world))
        raise TimeoutError(said if failure is None else f"{said}\n{failure}")
    return results_of(tmp, world, [p.exitcode for p in procs])


def rank_script(target: str, tmp: Path, **kwargs: Any) -> list[str]:
    """The arguments after torchrun's own that make each of its ranks run ``target(tmp,
    **kwargs)`` as :func:`spawn`'s ranks do (this module as the script)."""
    return [str(Path(__file__)), target, str(tmp), json.dumps(kwargs)]


def torchrun(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m torch.distributed.run ARGS`` from the checkout, in its own process group
    (killable as a whole), its output captured."""
    full_env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}:{REPO}", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """Waits for a torchrun launch: its exit code and output; after ``scaled(timeout)`` kills
    its whole process group and fails saying so."""
    limit = scaled(timeout)
    try:
        out, _ = proc.communicate(timeout=limit)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"{timed_out('the torchrun launch', limit)}:\n{out}") from None


def main() -> None:
    """torchrun's script (:func:`rank_script`): ``ranks.py MODULE:FUNCTION TMP KWARGS_JSON``."""
    target, tmp, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    run_rank(target, tmp, kwargs)


if __name__ == "__main__":
    main()
