"""The third fault set (issue 32, items 1 and 9), as the campaign ran it: a stop signal sent to the
whole job with loader workers, a save signal at any moment, a ``last/`` that lost its manifest,
a trace past the run's end, a save that fails for want of permission, and ``last/`` written twice.

Each is answered with one line naming the key or the checkpoint to use, and nothing is lost.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from giantpipe.checkpoint.run import read_checkpoint
from tests.integration.fault_runs import fingerprint, losses, run, start, summary, wait_for_step
from tests.support.train import error_lines, start_train
from tests.timeouts import scaled

pytestmark = pytest.mark.slow

# AmoebaNet-D on a folder of 16 px PNGs, read by two loader workers (as the ImageNet recipe reads
# its images); balanced by parameters, so no profiling at the start.
ON_IMAGES = [
    "recipe=amoebanet_quickstart",
    "data=images_folder",
    "data.batch_size=8",
    "data.num_workers=2",
    "pipeline.balance=params",
    "trainer.eval_every=0",
    "trainer.predict=false",
    "trainer.log_every=1",
    "logger.progress=none",
]


def on_images(run_dir: Path, photos: Path, *args: str) -> subprocess.Popen:
    """The run in a process group of its own, so the test can signal the whole job."""
    command = [*ON_IMAGES, f"data.root={photos}", f"hydra.run.dir={run_dir}", *args]
    return start_train(*command, cwd=run_dir.parent, start_new_session=True)


def test_sigterm_to_the_whole_job_with_loader_workers_saves_and_resumes(tmp_path: Path) -> None:
    """SLURM and `timeout` send SIGTERM to every process of the job: the loader workers died
    first and the run failed (`DataLoader worker (pid N) is killed by signal: Terminated`),
    losing the steps since the last checkpoint."""
    from giantpipe.data.images.generated import write_image_folder

    photos = write_image_folder(tmp_path / "photos", num_train=40, num_val=30, image_size=16)
    run_dir = tmp_path / "run"
    proc = on_images(run_dir, photos, "trainer.max_steps=2000")
    wait_for_step(run_dir, 3, proc, timeout=scaled(300))
    workers = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
    assert len(workers.stdout.split()) >= 3  # the run and its two loader workers
    os.killpg(proc.pid, signal.SIGTERM)  # the whole job, as `timeout` and SLURM send it
    _, err = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 143, err[-2000:]
    stopped = summary(run_dir)
    assert stopped["status"] == "preempted", stopped
    assert read_checkpoint(run_dir / "last")["step"] == stopped["steps"] >= 3
    assert "DataLoader worker" not in err and "Traceback" not in err
    more = stopped["steps"] + 2
    resumed = on_images(run_dir, photos, f"trainer.max_steps={more}", "trainer.resume=true")
    _, err = resumed.communicate(timeout=scaled(300))
    assert resumed.returncode == 0, err[-2000:]
    assert [step for step, _ in losses(run_dir)] == list(range(1, more + 1))


def test_a_save_signal_at_any_moment_of_the_run_never_kills_it(tmp_path: Path) -> None:
    """A save signal that came after the loop's handler was put back (the final evaluation and
    save) killed the process with SIGUSR1's default action (exit -10): signals every few
    milliseconds from step 1 to the process's exit."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.max_steps=8", "trainer.save_signal=SIGUSR1")
    wait_for_step(run_dir, 1, proc)
    sent = 0
    while proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)
        sent += 1
        time.sleep(0.005)
    _, err = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    assert summary(run_dir)["status"] == "completed" and sent > 10
    assert read_checkpoint(run_dir / "last")["step"] == 8


def kept_run(finished_run: Path) -> Path:
    """A run killed after its step-4 save (no summary), saving step_2 and step_4."""
    (finished_run / "summary.json").unlink()  # what a kill -9 leaves
    return finished_run


def test_a_missing_last_manifest_is_refused_naming_the_newest_step_and_nothing_changes(
    finished_run: Path,
) -> None:
    """`trainer.resume=auto` with `last/manifest.json` missing but good step_N/ started from
    step 0 (exit 0), moved the record aside, deleted last/'s save folder as a leftover and
    rewrote every step_N/. Every mode now refuses in one line naming the newest step_N/ (step_4,
    not step_2); what it names works."""
    run_dir = kept_run(finished_run)
    (run_dir / "last" / "manifest.json").unlink()
    before = fingerprint(run_dir)
    kept = run_dir / "step_4"
    for resume in ("auto", "true", "false"):
        result = run(run_dir, "trainer.max_steps=6", f"trainer.resume={resume}")
        assert result.returncode == 2, (resume, result.stderr[-2000:])
        assert error_lines(result) == [
            f"error: trainer.resume: {run_dir / 'last' / 'manifest.json'} is missing "
            f"({run_dir / 'last'} holds a save without its commit record); nothing was "
            f"changed: resume from {kept} with trainer.resume={kept}, or choose another "
            "hydra.run.dir"
        ], resume
        assert fingerprint(run_dir) == before, resume
    result = run(run_dir, "trainer.max_steps=6", f"trainer.resume={kept}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [step for step, _ in losses(run_dir)] == list(range(1, 7))


def test_step_copies_without_a_last_are_never_started_over(finished_run: Path) -> None:
    """With last/ gone entirely, a fresh start (auto, or trainer.overwrite=true) rewrote every
    kept step_N/."""
    run_dir = kept_run(finished_run)
    shutil.rmtree(run_dir / "last")
    before = fingerprint(run_dir)
    kept = run_dir / "step_4"
    result = run(run_dir, "trainer.max_steps=6", "trainer.resume=auto")
    assert error_lines(result) == [
        f"error: trainer.resume: no checkpoint at {run_dir / 'last'}, but {run_dir} keeps "
        f"step_4/; nothing was changed: resume from {kept} with trainer.resume={kept}, or "
        "choose another hydra.run.dir"
    ]
    result = run(run_dir, "trainer.max_steps=6", "trainer.overwrite=true")
    (line,) = error_lines(result)
    assert line.startswith(f"error: trainer.resume: {run_dir} already holds a run (step_4/")
    assert fingerprint(run_dir) == before


def test_a_trace_past_the_runs_end_is_refused_at_the_start(tmp_path: Path) -> None:
    """`trainer.trace_steps=[50]` in a 5-step run wrote nothing and said nothing."""
    result = run(tmp_path / "run", "trainer.max_steps=5", "trainer.trace_steps=[2,50]")
    assert result.returncode == 2
    assert error_lines(result) == [
        "error: trainer.trace_steps: [50] is past the run's end (it trains 5 optimizer steps), "
        "so nothing would be traced; choose steps from 1 to 5"
    ]
    assert not (tmp_path / "run").exists()


def saves_of(monkeypatch: pytest.MonkeyPatch, fail: tuple[str, int, OSError] | None = None):
    """Every save's (directory name, step), in order; ``fail``: (name, step, error) raises that
    error instead of writing that save."""
    from giantpipe.runner.run_state import staging

    real, done = staging.save_collective, []

    def save_collective(directory, token, *args, **kwargs):
        step = int(re.fullmatch(r"step(\d{9})-[0-9a-f]{6}", token).group(1))
        if fail is not None and (Path(directory).name, step) == fail[:2]:
            raise fail[2]
        done.append((Path(directory).name, step))
        return real(directory, token, *args, **kwargs)

    monkeypatch.setattr(staging, "save_collective", save_collective)
    return done


def test_a_permission_error_names_its_cause_and_the_newest_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save refused for want of permission said "free the space", and the "last good
    checkpoint" it named was last/ of step 2, not the newer step_4/ written just before."""
    from giantpipe.runner import train
    from giantpipe.runner.loop import CheckpointWriteError
    from tests.support.runs import tiny

    denied = PermissionError(13, "Permission denied", str(tmp_path / "last" / "x"))
    saves_of(monkeypatch, fail=("last", 4, denied))
    with pytest.raises(CheckpointWriteError) as info:
        train(tiny(max_steps=6, checkpoint_every=2, eval_every=0), tmp_path, "")
    kept = tmp_path / "step_4"
    assert str(info.value) == (
        f"{tmp_path / 'last' / 'x'}: cannot save the checkpoint of step 4 (Permission denied); "
        f"last good checkpoint: {kept} (step 4): make {tmp_path} writable for this user and "
        f"resume with trainer.resume={kept}"
    )
    assert read_checkpoint(kept)["step"] == 4 and read_checkpoint(tmp_path / "last")["step"] == 2


def test_a_step_that_evaluates_and_checkpoints_writes_last_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that both evaluated and kept a step_N/ wrote last/ twice (and the run's end a
    third time); a stop or save signal at such a step would have too."""
    from giantpipe.runner import train
    from tests.support.runs import tiny

    saves = saves_of(monkeypatch)
    train(tiny(max_steps=6, eval_every=3, checkpoint_every=3), tmp_path, "")
    assert saves == [("step_3", 3), ("last", 3), ("step_6", 6), ("last", 6)]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
