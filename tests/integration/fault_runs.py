"""The fault tests' run: the MLP quick start shrunk to seconds in a run directory of the test's,
started or run to its end by ``python train.py``, and what it left read back.

Example::

    result = run(tmp_path / "run", "trainer.max_steps=4")
    assert result.returncode == 0 and [step for step, _ in losses(tmp_path / "run")] == [1, 2, 3, 4]
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

from tests.support.runs import QUICK_MLP
from tests.support.train import start_train, train

TINY = [*QUICK_MLP, "trainer.predict=false", "logger.progress=none"]


def _existing(run_dir: Path) -> Path:
    """Where the command runs: the nearest folder above ``run_dir`` that exists."""
    return next(folder for folder in run_dir.parents if folder.exists())


def start(run_dir: Path, *args: str) -> subprocess.Popen[str]:
    """The tiny run into ``run_dir`` (``ARGS`` added), started."""
    return start_train(*TINY, f"hydra.run.dir={run_dir}", *args, cwd=_existing(run_dir))


def run(run_dir: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """The tiny run into ``run_dir`` (``ARGS`` added), to its end."""
    return train(*TINY, f"hydra.run.dir={run_dir}", *args, cwd=_existing(run_dir), timeout=timeout)


FINISHED = ("trainer.max_steps=4", "trainer.checkpoint_every=2")
"""The shared finished run: four steps, ``last/`` at step 4, ``step_2/`` and ``step_4/`` kept."""


def finish(run_dir: Path) -> Path:
    """The tiny run of :data:`FINISHED` into ``run_dir``, to its end (made once, then copied)."""
    done = run(run_dir, *FINISHED)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


def copy_of(finished: Path, where: Path) -> Path:
    """A copy of the finished run at ``where/run``, a test's own to damage."""
    return Path(shutil.copytree(finished, where / "run"))


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of every training step the run logged."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Returns once the run logged ``step`` lines; fails if it exits first or takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and sum(1 for _ in path.open()) >= step:
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def fingerprint(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` but the log, by its SHA-256."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "train.log"
    }
