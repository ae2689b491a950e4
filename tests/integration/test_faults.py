"""The fault suite: what a hostile, careless or unlucky user does to ``python train.py``, and
that each time the user sees one clear line and nothing is lost.

kill -9 at random moments (saves included), SIGTERM and resume, Ctrl-C once and twice, a full
file system (a small tmpfs when the tests run as root, an injected write failure always), two
runs into one directory, a lock left by a dead run, NaN in training and in evaluation, a fresh
run into another run's record, resuming a finished run, a bad override on resume, a torn
metrics line, and a checkpoint that would run code when loaded.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.errors import CheckpointError
from giantpipe.checkpoint.run import read_checkpoint
from giantpipe.checkpoint.unpickling import safe_load
from tests.integration.fault_runs import (
    TINY,
    fingerprint,
    losses,
    run,
    start,
    summary,
    wait_for_step,
)
from tests.support.train import environment, error_lines, train, train_here
from tests.timeouts import scaled

STEPS = 12
LONG = 120
"""The SIGTERM run's length: the signal, sent at step 5, always lands in the loop however loaded
the machine (at 12 steps a loaded run could be past its last step and exit 0, completed)."""

pytestmark = pytest.mark.slow


def uninterrupted(tmp_path_factory: pytest.TempPathFactory, steps: int) -> list[tuple[int, float]]:
    """The uninterrupted run's loss at every step: the same job as the interrupted runs', trained
    in this process (the runs under test are train.py's; the reference needs no interpreter)."""
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    assert train_here(run_dir, *TINY, f"trainer.max_steps={steps}")["status"] == "completed"
    return losses(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float]]:
    return uninterrupted(tmp_path_factory, STEPS)


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float]]:
    return uninterrupted(tmp_path_factory, LONG)


def test_kill_9_at_random_moments_never_loses_a_checkpoint(tmp_path: Path, reference) -> None:
    run_dir, rng = tmp_path / "run", random.Random(13)
    args = [f"trainer.max_steps={STEPS}", "trainer.checkpoint_every=1"]
    for attempt in range(3):  # saves every step, so some kills land inside a save
        proc = start(run_dir, *args, *(["trainer.resume=true"] if attempt else []))
        wait_for_step(run_dir, 3 * attempt + 2, proc)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        proc.wait()
        if (run_dir / "last" / "manifest.json").exists():  # the committed one is whole
            assert read_checkpoint(run_dir / "last")["step"] >= 1
    result = run(run_dir, *args, "trainer.resume=true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert losses(run_dir) == reference  # every step once, the same trajectory
    assert not list(run_dir.rglob("*.tmp"))


def test_sigterm_saves_marks_preempted_and_resumes_exactly(
    tmp_path: Path, long_reference: list[tuple[int, float]]
) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, f"trainer.max_steps={LONG}")
    wait_for_step(run_dir, 5, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=scaled(60))
    assert time.monotonic() - sent < scaled(10)  # save and exit, not the 60 s above
    assert proc.returncode == 143, err[-2000:]
    stopped = summary(run_dir)
    assert stopped["status"] == "preempted"
    assert read_checkpoint(run_dir / "last")["step"] == stopped["steps"]
    assert f"preempted at step {stopped['steps']}: saved" in err
    result = run(run_dir, f"trainer.max_steps={LONG}", "trainer.resume=true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert losses(run_dir) == long_reference
    assert summary(run_dir)["status"] == "completed"


def test_save_signal_saves_and_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.max_steps=2000", "trainer.save_signal=SIGUSR1")
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGUSR1)
    # The run's own word for the save, then more steps: a run long enough that the signal
    # always lands in the loop, however loaded the machine (a 12-step run could be past its
    # last step, and the signal arrive in the final save: tests/integration/test_faults_third.py
    # sends signals there on purpose).
    log = run_dir / "train.log"
    deadline = time.monotonic() + 120
    while not (saves := re.findall(r"step (\d+): saved \S+ \(SIGUSR1 received\)", log.read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    wait_for_step(run_dir, int(saves[0]) + 2, proc)  # and goes on
    assert read_checkpoint(run_dir / "last")["step"] >= int(saves[0]) >= 3
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 143, err[-2000:]
    assert len(re.findall(r"\(SIGUSR1 received\)", log.read_text())) == 1
    assert summary(run_dir)["steps"] >= int(saves[0]) + 2


def test_ctrl_c_stops_at_the_step_boundary_and_twice_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "once"
    proc = start(run_dir, "trainer.max_steps=2000")
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert summary(run_dir)["status"] == "interrupted"
    assert read_checkpoint(run_dir / "last")["step"] == summary(run_dir)["steps"]

    run_dir = tmp_path / "twice"
    proc = start(run_dir, "trainer.max_steps=2000", "model.hidden=512", "model.depth=8")
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert summary(run_dir)["status"] in ("interrupted",)


def test_two_runs_into_one_directory_and_a_dead_runs_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = start(run_dir, "trainer.max_steps=2000")
    wait_for_step(run_dir, 2, first)
    second = run(run_dir, "trainer.max_steps=5", "trainer.resume=true")
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=scaled(60))
    (line,) = error_lines(second)
    assert line.startswith(f"error: hydra.run.dir: {run_dir} is in use by PID {first.pid}")
    # the first run was not disturbed: one trajectory, each step once
    steps = [step for step, _ in losses(run_dir)]
    assert steps == sorted(set(steps))

    # A lock left by a process that is gone is taken over, and the log says so.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    lock = {"pid": int(dead.stdout), "host": os.uname().nodename, "started": None, "since": "?"}
    (run_dir / ".giantpipe.lock").write_text(json.dumps(lock))
    more = f"trainer.max_steps={summary(run_dir)['steps'] + 2}"
    result = run(run_dir, more, "trainer.resume=true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "which is gone" in (run_dir / "train.log").read_text()
    assert not (run_dir / ".giantpipe.lock").exists()


def test_nan_in_training_or_evaluation_is_never_saved_as_good(tmp_path: Path) -> None:
    run_dir = tmp_path / "train"
    result = run(
        run_dir, "optim.lr=1e30", "optim.name=sgd", "model.norm=none", "trainer.max_steps=3"
    )
    (line,) = error_lines(result)
    assert result.returncode == 1 and "NonFiniteLossError" in line
    assert summary(run_dir)["status"] == "failed"
    assert not (run_dir / "last" / "manifest.json").exists()

    run_dir = tmp_path / "eval"
    result = run(
        run_dir, "optim.lr=1e30", "optim.name=sgd", "model.norm=none", "trainer.max_steps=1"
    )
    (line,) = error_lines(result)
    assert "is nan; stopped without saving (no checkpoint was written)" in line
    assert summary(run_dir)["status"] == "failed"
    assert not (run_dir / "last" / "manifest.json").exists()


def test_a_run_directory_is_never_mixed_or_silently_rewritten(finished_run: Path) -> None:
    run_dir = finished_run
    for kept in run_dir.glob("step_*"):  # a run that kept no step_N/ copies
        shutil.rmtree(kept)
    before = fingerprint(run_dir)

    # Resuming a finished run says so and changes nothing.
    result = run(run_dir, "trainer.max_steps=4", "trainer.resume=true")
    assert result.returncode == 0 and "the run is complete at step 4" in result.stdout
    assert fingerprint(run_dir) == before

    # A bad override on resume is one line, and the completed run stays as it was.
    result = run(run_dir, "trainer.max_steps=8", "trainer.resume=true", "model.hidden=32")
    (line,) = error_lines(result)
    assert line.startswith("error: trainer.resume:") and "does not fit" in line
    assert fingerprint(run_dir) == before and summary(run_dir)["status"] == "completed"

    # A fresh run into a directory holding a record but no checkpoint is refused ...
    shutil.rmtree(run_dir / "last")
    result = run(run_dir, "trainer.max_steps=4")
    (line,) = error_lines(result)
    assert "holds another run's record (metrics.jsonl, summary.json)" in line
    # ... or, asked to, moves that record aside and starts over.
    result = run(run_dir, "trainer.max_steps=4", "trainer.overwrite=true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run_dir / "replaced-1" / "metrics.jsonl").exists()
    assert [step for step, _ in losses(run_dir)] == [1, 2, 3, 4]


def test_a_refused_fresh_config_leaves_no_run_directory(tmp_path: Path) -> None:
    result = run(tmp_path / "outputs" / "x" / "run", "pipeline.chunks=0")
    (line,) = error_lines(result)
    assert line == "error: pipeline.chunks: must be >= 1, got 0"
    assert not (tmp_path / "outputs").exists()
    result = run(tmp_path / "run2", "sweep.objective=eval/acc")
    assert error_lines(result)[0].startswith("error: sweep.objective: 'eval/acc' is not a figure")
    assert not (tmp_path / "run2").exists()


def test_a_torn_metrics_line_never_blocks_a_resume(finished_run: Path) -> None:
    run_dir = finished_run
    shutil.rmtree(run_dir / "last")
    shutil.copytree(run_dir / "step_2", run_dir / "last")
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write('{"kind": "train", "step": 5, "lo')  # a full disk cut this line short
    result = run(run_dir, "trainer.max_steps=6", "trainer.resume=true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [step for step, _ in losses(run_dir)] == [1, 2, 3, 4, 5, 6]


def full_disk(tmp_path: Path) -> Path | None:
    """A 12 MiB tmpfs (root only); None where it cannot be mounted."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(where)])
    return where if done.returncode == 0 else None


def test_a_full_disk_is_one_line_and_the_last_good_checkpoint_survives(tmp_path: Path) -> None:
    small = full_disk(tmp_path)
    if small is None:
        pytest.skip("needs root to mount a small tmpfs (the injected failure test covers it)")
    try:
        run_dir = small / "run"
        result = run(
            run_dir, "trainer.max_steps=400", "trainer.checkpoint_every=1", "model.hidden=384"
        )
        (line,) = error_lines(result)
        assert "cannot save the checkpoint of step" in line and "No space left" in line
        assert "last good checkpoint" in line and "Traceback" not in result.stderr
        good = read_checkpoint(run_dir / "last")["step"]
        spare = tmp_path / "big" / "run"
        shutil.copytree(run_dir, spare)  # space freed: the run goes on from there
    finally:
        subprocess.run(["umount", str(small)])
    result = run(spare, f"trainer.max_steps={good + 2}", "model.hidden=384", "trainer.resume=true")
    assert result.returncode == 0, result.stderr[-2000:]
    assert good >= 1 and summary(spare)["steps"] == good + 2


def test_an_injected_write_failure_keeps_the_last_good_checkpoint(tmp_path, monkeypatch) -> None:
    from giantpipe.checkpoint import files
    from giantpipe.runner import train
    from giantpipe.runner.loop import CheckpointWriteError
    from giantpipe.runner.run_state import staging
    from tests.support.runs import tiny

    saves = {"n": 0}
    real, real_save = torch.save, staging.save_collective

    def counted_save(*args, **kwargs):
        saves["n"] += 1
        return real_save(*args, **kwargs)

    def failing_save(obj, handle, *args, **kwargs):
        if saves["n"] > 2:  # the third checkpoint hits a full disk
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . PytorchStreamWriter "
                "failed writing file data/0: file write failed"
            )
        return real(obj, handle, *args, **kwargs)

    monkeypatch.setattr(staging, "save_collective", counted_save)
    monkeypatch.setattr(files.torch, "save", failing_save)
    full = shutil._ntuple_diskusage(1, 1, 0)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda _: full)
    with pytest.raises(CheckpointWriteError) as info:
        train(tiny(max_steps=6, checkpoint_every=1, eval_every=0), tmp_path, "")
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message
    assert f"last good checkpoint: {tmp_path / 'last'} (step 1)" in message
    assert read_checkpoint(tmp_path / "last")["step"] == 1
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": {}, "step": 1, "payload": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"holds posix.system, which giantpipe never saves"):
        safe_load(tmp_path / "evil.pt")
    result = run(tmp_path / "run", f"trainer.init_from={tmp_path / 'evil.pt'}")
    (line,) = error_lines(result)
    assert line.startswith("error: trainer.init_from:") and "never saves" in line
    assert not marker.exists()


# -- checkpoints that are damaged, and files the run did not write (issue 22) -----------------

QUICKSTART = ["recipe=mlp_quickstart"]


def quickstart(cwd: Path, run_dir: str, *args: str) -> subprocess.CompletedProcess:
    """``python train.py recipe=mlp_quickstart hydra.run.dir=RUN_DIR ARGS``, as a user types it."""
    return train(*QUICKSTART, f"hydra.run.dir={run_dir}", *args, cwd=cwd, timeout=300)


def consolidate(directory: Path, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "giantpipe.consolidate", str(directory), str(out)]
    return subprocess.run(
        command, env=environment(), capture_output=True, text=True, timeout=scaled(120)
    )


def test_a_damaged_manifest_is_refused_and_nothing_is_removed(finished_run: Path) -> None:
    """Found item 1: `R trainer.max_steps=40`, one character of last/manifest.json damaged,
    `R trainer.resume=true` removed the weights before refusing. (The shared finished run
    stands for the 40 steps: what is damaged and resumed is the same ``last/``.)"""
    run_dir = finished_run
    for kept in run_dir.glob("step_*"):  # last/ alone, as that run kept it
        shutil.rmtree(kept)
    manifest = run_dir / "last" / "manifest.json"
    manifest.write_text("x" + manifest.read_text()[1:])  # one character damaged
    before = fingerprint(run_dir)
    result = run(run_dir, "trainer.max_steps=6", "trainer.resume=true")
    (line,) = error_lines(result)
    assert line.startswith(f"error: trainer.resume: {manifest} is damaged"), line
    assert "nothing was removed" in line
    assert fingerprint(run_dir) == before  # the weights are all there: one character to repair
    assert "removed" not in (run_dir / "train.log").read_text()


def test_a_run_removes_no_file_it_did_not_write(tmp_path: Path) -> None:
    """Found item 3: `mkdir d d/step_7; echo notes > d/notes.tmp; echo x > d/step_7/step1-rank0.pt;
    R(d)` deleted both files; with hydra.run.dir=. every *.tmp of the user's directory went."""
    d = tmp_path / "d"
    (d / "step_7").mkdir(parents=True)
    (d / "notes.tmp").write_text("notes\n")
    (d / "step_7" / "step1-rank0.pt").write_text("x\n")
    result = quickstart(tmp_path, "d", "trainer.max_steps=2")  # what it removes, it removes at once
    assert result.returncode == 0, result.stderr[-2000:]
    assert (d / "notes.tmp").read_text() == "notes\n"
    assert (d / "step_7" / "step1-rank0.pt").read_text() == "x\n"

    here = tmp_path / "here"
    here.mkdir()
    (here / "draft.tmp").write_text("mine\n")
    result = quickstart(here, ".", "trainer.max_steps=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (here / "draft.tmp").read_text() == "mine\n"


def weight_file(last: Path) -> tuple[Path, int]:
    """The file of ``last`` holding the largest weight, and where its bytes start."""
    model = read_checkpoint(last)["model"]
    name = max(model, key=lambda n: model[n].numel())
    raw = model[name].numpy().tobytes()
    for path in sorted(p for p in last.rglob("*") if p.is_file()):
        at = path.read_bytes().find(raw)
        if at >= 0:
            return path, at
    raise AssertionError(f"no file of {last} holds {name}")


def test_flipped_bytes_in_a_weight_are_refused_by_resume_and_consolidate(
    tmp_path: Path, finished_run: Path
) -> None:
    """Found item 2: four bytes XORed in a weight were trained on (rc 0) and consolidated."""
    run_dir = finished_run  # four steps, step_2/ and step_4/ kept
    path, at = weight_file(run_dir / "last")
    data = bytearray(path.read_bytes())
    for i in range(at + 8, at + 12):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    result = run(run_dir, "trainer.max_steps=6", "trainer.resume=true")
    (line,) = error_lines(result)
    kept = run_dir / "step_4"
    assert line == (
        f"error: trainer.resume: {path} is damaged (content hash differs from the commit "
        f"record); resume from {kept} with trainer.resume={kept}"
    )
    # Fine-tuning from it is refused too, naming the setting that asked for it.
    (line,) = error_lines(run(tmp_path / "tuned", f"trainer.init_from={run_dir / 'last'}"))
    assert line == (
        f"error: trainer.init_from: {path} is damaged (content hash differs from the commit "
        f"record); start from {kept} with trainer.init_from={kept}"
    )
    merged = consolidate(run_dir / "last", tmp_path / "model.pt")
    assert merged.returncode == 2 and not (tmp_path / "model.pt").exists()
    assert merged.stderr.strip().splitlines() == [
        f"consolidate: {path} is damaged (content hash differs from the commit record); "
        f"export {kept} instead"
    ]
    # What the line says to do works: the kept step_4 resumes, into the same directory.
    result = run(run_dir, "trainer.max_steps=6", f"trainer.resume={kept}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [step for step, _ in losses(run_dir)] == [1, 2, 3, 4, 5, 6]


def test_a_truncated_shard_is_one_line_naming_it(tmp_path: Path, finished_run: Path) -> None:
    """Found item 4: a truncated shard gave `OSError: [Errno 22] Invalid argument`, naming
    nothing, on resume and in consolidate."""
    run_dir = finished_run
    path, _ = weight_file(run_dir / "last")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    result = run(run_dir, "trainer.max_steps=6", "trainer.resume=true")
    (line,) = error_lines(result)
    assert line.startswith(f"error: trainer.resume: {path} is damaged (truncated: ")
    assert "Traceback" not in result.stderr
    merged = consolidate(run_dir / "last", tmp_path / "model.pt")
    assert merged.returncode == 2
    (said,) = merged.stderr.strip().splitlines()
    assert said.startswith(f"consolidate: {path} is damaged (truncated: {len(data) // 2} of ")
