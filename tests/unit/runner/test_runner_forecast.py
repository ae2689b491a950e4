"""trainer.predict: the simulator's forecast in every run's summary, beside the measured engine
step, without changing what the run trains; the comparison line and its warning."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from giantpipe.checkpoint.run import read_checkpoint
from giantpipe.config import ExperimentConfig, LoggerConfig, PipelineConfig, TrainerConfig
from giantpipe.data.options import SyntheticDataConfig
from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from giantpipe.runner.forecast import Forecast
from models.options import MlpModelConfig

PREDICTED = (
    "pipeline/predicted_step_time_s",
    "pipeline/predicted_bubble",
    "pipeline/predicted_peak_memory_bytes",
)


def tiny(predict: bool, dropout: float = 0.0) -> ExperimentConfig:
    return ExperimentConfig(
        name="tiny",
        model=MlpModelConfig(in_features=8, hidden=16, depth=3, classes=4, dropout=dropout),
        data=SyntheticDataConfig(
            features=8, classes=4, train_size=256, eval_size=64, batch_size=16
        ),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=4),
        trainer=TrainerConfig(max_steps=4, eval_every=0, log_every=1, predict=predict),
        logger=LoggerConfig(progress="none"),
    )


def test_summary_has_the_prediction_beside_the_measured_step(tmp_path: Path, caplog):
    with caplog.at_level(logging.INFO, logger="giantpipe.runner.forecast"):
        summary = train(tiny(predict=True), tmp_path, "name: tiny\n")
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in (*PREDICTED, "pipeline/step_time_s", "pipeline/step_time_vs_predicted"):
        assert key in saved and key in summary
    assert 0 < saved["pipeline/predicted_step_time_s"] < 10
    assert 0 <= saved["pipeline/predicted_bubble"] < 1
    peaks = saved["pipeline/predicted_peak_memory_bytes"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks)
    assert saved["pipeline/step_time_vs_predicted"] == pytest.approx(
        saved["pipeline/step_time_s"] / saved["pipeline/predicted_step_time_s"] - 1
    )
    assert 0 < saved["pipeline/predict_time_s"] < saved["wall_time_s"]
    assert any("predicted step" in r.message and "| measured" in r.message for r in caplog.records)


def test_switched_off_the_summary_has_no_prediction(tmp_path: Path):
    summary = train(tiny(predict=False), tmp_path, "name: tiny\n")
    assert not [k for k in summary if "predict" in k]


def test_the_prediction_changes_nothing_the_run_trains(tmp_path: Path):
    # dropout draws from the RNG streams that predict would disturb if not forked
    runs = {}
    for predict in (True, False):
        run_dir = tmp_path / str(predict)
        train(tiny(predict, dropout=0.3), run_dir, "name: tiny\n")
        losses = [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
        runs[predict] = losses, read_checkpoint(run_dir / "last")["model"]
    assert runs[True][0] == runs[False][0]
    for name, tensor in runs[True][1].items():
        assert torch.equal(tensor, runs[False][1][name]), name


def _stats(wall: float, bubble: float) -> SimpleNamespace:
    return SimpleNamespace(wall_time_s=wall, bubble=bubble)


def test_line_and_warning(caplog):
    forecast = Forecast()
    forecast.prediction = SimpleNamespace(step_time_s=0.1, bubble=0.2)  # type: ignore[assignment]
    forecast._done = True
    assert (
        forecast.line()
        == "predicted step 0.1 s bubble 0.20 | measured: no step after the prediction"
    )
    forecast.after_step(None, "fp32", None, [_stats(0.10, 0.2), _stats(0.112, 0.24)], 2, True)
    assert (
        forecast.line() == "predicted step 0.1 s bubble 0.20 | measured 0.106 s bubble 0.22 (+6%)"
    )
    with caplog.at_level(logging.INFO, logger="giantpipe.runner.forecast"):
        forecast.report()
    assert [r.levelname for r in caplog.records] == ["INFO"]
    forecast.after_step(None, "fp32", None, [_stats(0.3, 0.2)], 3, True)  # mean 0.171: +71%
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="giantpipe.runner.forecast"):
        forecast.report()
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
    assert "more than 25%" in caplog.records[1].message
