"""The second edge set (issue 22, items 5-9), as the fault campaign ran it: real commands through
``python train.py``, each answered with one line naming the key or file and nothing lost.

A local timeout no thread can wait, a data file that would run code, a dropped SSH session, a
resume with another seed, and a killed sweep restarted with one command.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import termios
import time
from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.run import read_checkpoint
from tests.integration.fault_runs import TINY, fingerprint, losses, run, summary
from tests.support.train import error_lines, start_train, train
from tests.timeouts import scaled

pytestmark = pytest.mark.slow


def test_a_local_timeout_past_a_week_is_one_line_and_no_run(tmp_path: Path) -> None:
    """It used to pass the checks and kill step 1 (OverflowError, blamed on stage 1)."""
    result = run(tmp_path / "run", "trainer.max_steps=2", "pipeline.timeout=1e10")
    assert error_lines(result) == [
        "error: pipeline.timeout: must be at most 604800 s (a week), how long a stage may wait "
        "for another before the step fails; got 10000000000.0"
    ]
    assert result.returncode != 0 and not (tmp_path / "run").exists()


def test_a_data_file_that_would_run_code_is_refused_and_leaves_no_run(tmp_path: Path) -> None:
    marker, root = tmp_path / "ran", tmp_path / "data"
    root.mkdir()

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save((torch.randn(64, 16), torch.randint(0, 8, (64,)), Payload()), root / "train.pt")
    torch.save((torch.randn(64, 16), torch.randint(0, 8, (64,))), root / "eval.pt")
    data = ["data=tensors", f"data.root={root}", "data.features=16", "data.classes=8"]
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    result = train("recipe=mlp_quickstart", *data, run_dir, cwd=tmp_path, timeout=180)
    (line,) = error_lines(result)
    assert line.startswith(
        f"error: data.root: {root / 'train.pt'} holds posix.system, which a data file of "
        "tensors never needs; refused without running it"
    )
    assert "weights_only" not in result.stderr and "Traceback" not in result.stderr
    assert result.returncode != 0 and not marker.exists()
    assert not (tmp_path / "run").exists()


def as_over_ssh() -> None:
    """In the child: the pty as its controlling terminal, and SIGHUP's default disposition, as
    a shell over SSH has it (pytest itself may run under ``nohup``, whose ignored SIGHUP the
    child would inherit, and a run under nohup goes on by design)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def on_a_terminal(run_dir: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """The run in a session of its own whose controlling terminal is a pty, as over SSH; closing
    the returned master end is the session dropping (the kernel sends SIGHUP)."""
    master, slave = pty.openpty()
    proc = start_train(
        *TINY,
        f"hydra.run.dir={run_dir}",
        *args,
        "logger.progress=tqdm",  # a bar on the terminal at every step
        cwd=run_dir.parent,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=as_over_ssh,
    )
    os.close(slave)
    return proc, master


def test_a_dropped_ssh_session_saves_exits_129_and_resumes(tmp_path: Path) -> None:
    """SIGHUP used to kill the run (rc 129) without a save: up to eval_every steps lost."""
    run_dir = tmp_path / "run"
    proc, master = on_a_terminal(run_dir, "trainer.max_steps=2000")
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "no step 3"
        if select.select([master], [], [], 0.05)[0]:
            os.read(master, 1 << 16)  # keep the terminal flowing
    os.close(master)  # the session drops
    assert proc.wait(timeout=scaled(60)) == 129
    stopped = summary(run_dir)
    assert stopped["status"] == "hangup"
    assert read_checkpoint(run_dir / "last")["step"] == stopped["steps"] >= 3
    more = stopped["steps"] + 2
    result = run(run_dir, f"trainer.max_steps={more}", "trainer.resume=true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [step for step, _ in losses(run_dir)] == list(range(1, more + 1))


def test_a_resume_with_another_seed_is_refused_unless_meant(finished_run: Path) -> None:
    run_dir = finished_run  # four steps, seed 0
    before = fingerprint(run_dir)
    result = run(run_dir, "trainer.max_steps=6", "trainer.resume=true", "trainer.seed=1")
    assert error_lines(result) == [
        f"error: trainer.seed: changed from the run being resumed ({run_dir / 'config.yaml'}: "
        "trainer.seed 0 -> 1); a resume continues that run: set it back, or pass "
        "trainer.resume_changed=[trainer.seed] if the change is meant"
    ]
    assert result.returncode != 0 and fingerprint(run_dir) == before
    # Meant, and with another pipeline shape (always free): the run goes on.
    meant = ["trainer.resume_changed=[trainer.seed]", "pipeline.chunks=2"]
    result = run(run_dir, "trainer.max_steps=6", "trainer.resume=true", "trainer.seed=1", *meant)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [step for step, _ in losses(run_dir)] == [1, 2, 3, 4, 5, 6]


def sweep(sweep_dir: Path, *args: str) -> subprocess.CompletedProcess:
    steps = ["trainer.max_steps=4", "trainer.checkpoint_every=2", "pipeline.chunks=1,2,4"]
    where = f"hydra.sweep.dir={sweep_dir}"
    return train("-m", *TINY, *steps, where, *args, cwd=sweep_dir.parent, timeout=300)


def test_resume_auto_restarts_a_killed_sweep_with_one_command(tmp_path: Path) -> None:
    """Job 0 finished, job 1 was killed after its step-2 checkpoint, job 2 never started: a plain
    rerun refuses job 0 and trainer.resume=true fails job 2; resume=auto finishes the sweep."""
    jobs = tmp_path / "sweep"
    done = sweep(jobs)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = {job: losses(jobs / job) for job in ("0", "1", "2")}
    # Job 1 as a kill after its step-2 save leaves it; job 2 as it was before it started.
    killed = jobs / "1"
    shutil.rmtree(killed / "last")
    shutil.copytree(killed / "step_2", killed / "last")
    shutil.rmtree(killed / "step_4")
    (killed / "summary.json").unlink()
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    (killed / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")  # torn after step 3
    shutil.rmtree(jobs / "2")
    finished = fingerprint(jobs / "0")

    result = sweep(jobs, "trainer.resume=auto")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{jobs / '0'}: the run is complete at step 4; nothing was changed" in result.stdout
    assert fingerprint(jobs / "0") == finished
    for job in ("1", "2"):
        assert json.loads((jobs / job / "summary.json").read_text())["status"] == "completed"
        assert losses(jobs / job) == expected[job]  # every step once, the same trajectory
