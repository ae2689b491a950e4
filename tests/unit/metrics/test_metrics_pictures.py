"""Sinks and pictures: the TensorBoard sink holds the scalars; every run draws curves.png; a
sweep's table lists every job (refused ones too) with its swept keys and objective."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from giantpipe.config import LoggerConfig
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.step import StepRecord
from giantpipe.metrics.sweep import write_sweep_table

PNG = b"\x89PNG\r\n\x1a\n"


def record(step: int, loss: float) -> StepRecord:
    stats = SimpleNamespace(
        wall_time_s=1.0,
        span_s=1.0,
        busy_time_s=[0.1, 0.2],
        recompute_time_s=[0.0, 0.0],
        bubble=0.25,
        expected_bubble=0.2,
        peak_memory_bytes=[10, 20],
        memory_kind="saved_activations",
        clock="perf_counter",
    )
    figures = dict(step=step, loss=loss, lr=0.1, step_time_s=0.5, samples=32, tokens=None)
    return StepRecord.from_engine([stats], **figures)


def run(tmp_path: Path, **logger) -> MetricsLogger:
    metrics = MetricsLogger(
        LoggerConfig(progress="none", **logger), tmp_path, 4, 0, 2, name="t", config={}
    )
    for step in range(1, 5):
        metrics.train_step(record(step, loss=2.0 / step))
    metrics.evaluation(4, {"loss": 0.7, "accuracy": 0.5})
    metrics.close({"steps": 4})
    return metrics


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, tensorboard=True)
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "eval/loss", "eval/accuracy"} <= tags
    assert {"train/busy_time_s/stage0", "train/busy_time_s/stage1"} <= tags
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(2, 1.5), (4, pytest.approx((2 / 3 + 2 / 4) / 2))]  # window means
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(4, 0.5)]


def test_no_event_file_unless_asked(tmp_path: Path) -> None:
    run(tmp_path)
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize("jsonl", [True, False])
def test_every_run_draws_its_loss_and_evaluation_curves(tmp_path: Path, jsonl: bool) -> None:
    run(tmp_path, jsonl=jsonl)
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG)


def job(sweep: Path, number: int, overrides: str, summary: dict | None) -> None:
    folder = sweep / str(number)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"# overrides: {overrides}\nname: x\n")
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))


def test_sweep_table_lists_every_job_against_its_objective(tmp_path: Path) -> None:
    job(tmp_path, 1, "recipe=a pipeline.chunks=2 optim.lr=0.1", {"status": "completed",
        "eval/loss": 0.5})  # fmt: skip
    job(tmp_path, 2, "recipe=a pipeline.chunks=4 optim.lr=0.1", {"status": "failed"})
    launched = {0: ["recipe=a", "pipeline.chunks=0", "optim.lr=0.1"], 1: [], 2: []}
    md, csv, png = write_sweep_table(tmp_path, "eval/loss", launched)
    assert csv.read_text().splitlines() == [
        "job,pipeline.chunks,status,eval/loss",
        "0,0,refused,nan",
        "1,2,completed,0.5",
        "2,4,failed,nan",
    ]
    assert "| 1 | 2 | completed | 0.5 |" in md.read_text()
    assert png.read_bytes().startswith(PNG)
    assert math.isnan(float(csv.read_text().splitlines()[1].rsplit(",", 1)[1]))


def test_starting_over_moves_the_curves_and_events_aside_with_the_record(tmp_path: Path) -> None:
    from giantpipe.runner.rundir import move_record_aside

    run(tmp_path, tensorboard=True)
    aside = move_record_aside(tmp_path)
    assert (aside / "curves.png").is_file() and list((aside / "tensorboard").iterdir())
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "curves.png").exists()


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, tensorboard=True)  # steps 1-4 logged at 2 and 4; say it stopped after step 2
    cfg = LoggerConfig(progress="none", tensorboard=True)
    resumed = MetricsLogger(cfg, tmp_path, 4, 2, 2, name="t", config={})
    for step in (3, 4):
        resumed.train_step(record(step, loss=9.0))
    resumed.close({"steps": 4})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(2, 1.5), (4, 9.0)]
