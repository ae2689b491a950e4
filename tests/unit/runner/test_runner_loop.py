"""The training loop in-process on a tiny model: outputs, stops, resumption rules."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    PipelineConfig,
    TrainerConfig,
)
from giantpipe.data.bundle import DataBundle
from giantpipe.data.tensors import SyntheticDataConfig, classification
from giantpipe.metrics.sinks import read_jsonl
from giantpipe.runner import train
from giantpipe.runner.loop import NonFiniteLossError
from models.mlp import MlpModelConfig

NAN_FROM = 3  # the training batch from which nan_data returns NaN inputs


def nan_data(features: int, classes: int) -> DataBundle:
    """Generated data whose batches turn to NaN from position NAN_FROM on."""
    clean = classification(features, classes, train_size=256, eval_size=32, batch_size=16)

    def batches(seed: int, position: int):
        for index, (x, y) in enumerate(clean.train_batches(seed, position), start=position):
            yield (x * math.nan if index >= NAN_FROM else x), y

    return replace(clean, train_batches=batches)


def tiny(**trainer) -> ExperimentConfig:
    return ExperimentConfig(
        name="tiny",
        model=MlpModelConfig(in_features=8, hidden=16, depth=3, classes=4),
        data=SyntheticDataConfig(
            features=8, classes=4, train_size=256, eval_size=64, batch_size=16
        ),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        trainer=TrainerConfig(**{"max_steps": 6, "eval_every": 3, "log_every": 2, **trainer}),
        logger=LoggerConfig(progress="none"),
    )


def test_run_writes_metrics_summary_config_and_checkpoint(tmp_path: Path, capsys):
    summary = train(tiny(checkpoint_every=4), tmp_path, "name: tiny\n")
    assert summary["status"] == "completed" and summary["steps"] == 6
    for key in (
        "eval/loss",
        "eval/accuracy",
        "train/loss",
        "train/samples_per_s",
        "pipeline/bubble",
        "pipeline/expected_bubble",
        "pipeline/busy_time_s",
        "pipeline/peak_memory_bytes",
    ):
        assert key in summary, key
    assert summary["pipeline/expected_bubble"] == pytest.approx(1 / 3)  # K=2, M=2
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    train_steps = [r["step"] for r in lines if r["kind"] == "train"]
    eval_steps = [r["step"] for r in lines if r["kind"] == "eval"]
    assert (train_steps, eval_steps) == ([2, 4, 6], [3, 6])
    first = next(r for r in lines if r["kind"] == "train")
    for key in (
        "loss",
        "lr",
        "samples_per_s",
        "step_time_s",
        "bubble",
        "expected_bubble",
        "busy_time_s",
        "peak_memory_bytes",
    ):
        assert key in first, key
    assert len(first["busy_time_s"]) == len(first["peak_memory_bytes"]) == 2
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6
    assert torch.load(tmp_path / "last.pt", weights_only=False)["step"] == 6
    assert torch.load(tmp_path / "step_4.pt", weights_only=False)["step"] == 4
    assert (tmp_path / "config.yaml").read_text() == "name: tiny\n"
    assert "eval loss" in capsys.readouterr().out


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path):
    cfg = tiny(eval_every=2, max_steps=8)
    cfg.data = {"_target_": f"{__name__}.nan_data", "features": 8, "classes": 4}
    with pytest.raises(NonFiniteLossError, match=r"step 4: the loss is nan; .*last.pt \(step 2\)"):
        train(cfg, tmp_path, "")
    assert torch.load(tmp_path / "last.pt", weights_only=False)["step"] == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 3


def test_fresh_run_refuses_a_directory_holding_a_run(tmp_path: Path):
    train(tiny(max_steps=2), tmp_path, "")
    before = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(ConfigError, match="trainer.resume: .* already holds a run"):
        train(tiny(max_steps=2), tmp_path, "")
    assert (tmp_path / "last.pt").read_bytes() == before


def test_resume_continues_the_same_losses_even_with_dropout(tmp_path: Path):
    def cfg(**trainer) -> ExperimentConfig:
        c = tiny(log_every=1, **trainer)
        c.model = MlpModelConfig(in_features=8, hidden=16, depth=3, classes=4, dropout=0.2)
        return c

    full = train(cfg(max_steps=6), tmp_path / "full", "")
    train(cfg(max_steps=3), tmp_path / "part", "")
    resumed = train(cfg(max_steps=6, resume=True), tmp_path / "part", "")
    assert resumed["eval/loss"] == full["eval/loss"]
    losses = {
        name: [
            r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"
        ]
        for name in ("full", "part")
    }
    assert losses["part"] == losses["full"]
    assert (tmp_path / "part" / "config.resume_3.yaml").exists()


def test_accumulation_ema_bf16_and_epochs(tmp_path: Path):
    cfg = tiny(max_steps=None, max_epochs=0.25, accumulate=2, ema_decay=0.9, grad_clip=1.0)
    cfg.pipeline = PipelineConfig(devices="cpu", num_devices=2, chunks=2, precision="bf16")
    summary = train(cfg, tmp_path, "")
    # 256 / 16 = 16 batches per epoch = 8 optimizer steps per epoch; a quarter epoch is 2 steps.
    assert summary["steps"] == 2
    assert math.isfinite(summary["eval/loss"])
    assert "ema" in torch.load(tmp_path / "last.pt", weights_only=False)


def test_resume_from_a_path_will_not_overwrite_another_run(tmp_path: Path):
    train(tiny(max_steps=2), tmp_path / "a", "")
    train(tiny(max_steps=2), tmp_path / "b", "")
    before = (tmp_path / "b" / "last.pt").read_bytes()
    with pytest.raises(ConfigError, match="holds another run's last.pt"):
        train(tiny(max_steps=4, resume=str(tmp_path / "a" / "last.pt")), tmp_path / "b", "")
    assert (tmp_path / "b" / "last.pt").read_bytes() == before
