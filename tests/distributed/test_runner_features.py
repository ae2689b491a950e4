"""What reached torchrun with the one runner: BLEU (whole-model evaluation), the planner, device
lists, the simulator's forecast, and checkpoints shared with the local executor both ways."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from giantpipe.metrics.jsonl import read_jsonl
from tests import tiny
from tests.support.ranks import finish
from tests.support.train import train_here, train_under_torchrun

pytestmark = pytest.mark.distributed

TRANSLATION = [
    *tiny.TRANSLATION,
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "trainer.predict=false",
    "logger.progress=none",
]
MLP = [
    "recipe=mlp_quickstart",
    "data.train_size=512",
    "data.eval_size=128",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "logger.progress=none",
]


def launch(run_dir: Path, *overrides: str) -> str:
    """``torchrun --nproc_per_node=2 train.py ... pipeline.executor=distributed``."""
    proc = train_under_torchrun(run_dir, *overrides)
    code, output = finish(proc, timeout=240)
    assert code == 0, output
    return output


def local(run_dir: Path, *overrides: str) -> None:
    """The same job with the local executor, in this process (as ``train.py`` runs it: the
    config composed, checked and recorded; no second interpreter to import torch again)."""
    summary = train_here(run_dir, *overrides)
    assert summary["status"] == "completed", summary


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def test_bleu_under_torchrun_equals_the_local_runs(tmp_path: Path) -> None:
    local(tmp_path / "local", *TRANSLATION)
    launch(tmp_path / "dist", *TRANSLATION)
    here, there = summary(tmp_path / "local"), summary(tmp_path / "dist")
    assert there["status"] == "completed" and there["pipeline/world_size"] == 2
    for key in ("eval/loss", "eval/bleu"):
        assert there[key] == pytest.approx(here[key], rel=1e-4), key
    assert any(k.startswith("eval/bleu_") for k in there)  # per pair, as the local run


def test_planner_device_list_and_forecast_under_torchrun(tmp_path: Path) -> None:
    run = tmp_path / "run"
    devices = "pipeline.devices=[cpu,cpu]"
    output = launch(run, *MLP, "trainer.max_steps=3", "pipeline.plan=auto", devices)
    result = summary(run)
    assert result["status"] == "completed"
    choice = result["pipeline/plan_choice"]
    assert result["pipeline/balance"] == choice["balance"]
    assert result["pipeline/chunks"] == choice["chunks"]
    assert result["pipeline/devices"] == ["cpu", "cpu"]
    assert output.count("pipeline.plan=auto") >= 1  # rank 0 alone plans and logs the table
    # trainer.predict: forecast from every rank's timings of step 2, measured on step 3
    assert 0 < result["pipeline/predicted_step_time_s"] < 10
    assert 0 <= result["pipeline/predicted_bubble"] < 1
    assert result["pipeline/step_time_vs_predicted"] == pytest.approx(
        result["pipeline/step_time_s"] / result["pipeline/predicted_step_time_s"] - 1
    )
    assert (run / "timeline_predicted.png").exists()


def test_checkpoints_move_between_the_executors(tmp_path: Path) -> None:
    steps = [*MLP, "trainer.checkpoint_every=3", "trainer.max_steps=8"]
    local(tmp_path / "full", *steps)
    expected = losses(tmp_path / "full")
    # torchrun resumes the local run's step-3 checkpoint (one shard: K=2 in one process) ...
    launch(tmp_path / "dist", *steps, f"trainer.resume={tmp_path / 'full' / 'step_3'}")
    assert losses(tmp_path / "dist") == pytest.approx(expected[3:], rel=1e-5)
    # ... and one process resumes torchrun's step 6 (two shards, two state files) with K=3.
    back = tmp_path / "back"
    local(back, *steps, "pipeline.num_devices=3", f"trainer.resume={tmp_path / 'dist' / 'step_6'}")
    assert losses(back) == pytest.approx(expected[6:], rel=1e-4)
    assert len(summary(back)["pipeline/balance"]) == 3


def test_sigterm_under_torchrun_saves_every_shard(tmp_path: Path) -> None:
    """SIGTERM to torchrun (what SLURM sends): it passes it on, every rank finishes the same
    step and saves its shard of it, rank 0 marks the run preempted; the resume continues."""
    run = tmp_path / "run"
    proc = train_under_torchrun(run, *MLP, "trainer.max_steps=5000", "trainer.predict=false")
    deadline = time.monotonic() + 180
    while len(losses(run) if (run / "metrics.jsonl").exists() else []) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc, 1)[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    finish(proc, timeout=90)
    stopped = summary(run)
    assert stopped["status"] == "preempted", stopped
    manifest = json.loads((run / "last" / "manifest.json").read_text())
    assert manifest["step"] == stopped["steps"] >= 3
    assert len(manifest["shards"]) == 2 and len(manifest["extra"]["state_files"]) == 2
    launch(run, *MLP, f"trainer.max_steps={stopped['steps'] + 2}", "trainer.resume=true")
    assert summary(run)["status"] == "completed"
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, stopped["steps"] + 3))


def test_sigterm_under_torchrun_with_loader_workers_saves_every_shard(tmp_path: Path) -> None:
    """torchrun passes SIGTERM on to each rank's process group (every rank runs in a session of
    its own), loader workers included: they died first and every rank failed (`DataLoader
    worker (pid N) is killed by signal: Terminated`, issue 32 item 1). Now each rank's workers
    leave it to the rank, which saves its shard and stops with the others."""
    from giantpipe.data.images.generated import write_image_folder

    photos = write_image_folder(tmp_path / "photos", num_train=40, num_val=30, image_size=16)
    images = [
        "recipe=amoebanet_quickstart",
        "data=images_folder",
        f"data.root={photos}",
        "data.batch_size=8",
        "data.num_workers=2",
        "pipeline.balance=params",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.predict=false",
        "logger.progress=none",
    ]
    run = tmp_path / "run"
    proc = train_under_torchrun(run, *images, "trainer.max_steps=5000", timeout=120)
    deadline = time.monotonic() + 300
    while len(losses(run) if (run / "metrics.jsonl").exists() else []) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc, 1)[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, output = finish(proc, timeout=120)
    assert "DataLoader worker" not in output, output[-3000:]
    stopped = summary(run)
    assert stopped["status"] == "preempted", stopped
    manifest = json.loads((run / "last" / "manifest.json").read_text())
    assert manifest["step"] == stopped["steps"] >= 2 and len(manifest["shards"]) == 2


def test_a_rank_that_dies_is_named_in_rank_0s_summary(tmp_path: Path) -> None:
    """Rank 1 (the head's stage) dies in step 3: every survivor names it, never itself or "a
    peer", and rank 0 records the failure in summary.json, whichever of the engine's own
    detection and torchrun's SIGTERM reaches it first."""
    run = tmp_path / "run"
    proc = train_under_torchrun(
        run,
        *MLP,
        "model._target_=tests.distributed.failing_model.mlp",
        "trainer.max_steps=6",
        "trainer.predict=false",
        env={"GIANTPIPE_TEST_DIE_AT": "9"},  # a forward of step 2 or 3 (with recompute)
    )
    code, output = finish(proc, timeout=120)
    assert code != 0, output
    failed = summary(run)
    assert failed["status"] == "failed" and failed["steps"] < 6, failed
    assert failed["error"].startswith("rank 1 (stage 1) is gone"), failed
    assert "peer" not in failed["error"], failed
