"""Top-5 evaluation and fine-tuning from a checkpoint (trainer.init_from) on a tiny AmoebaNet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.run import read_checkpoint
from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    PipelineConfig,
    TrainerConfig,
)
from giantpipe.data.images.bundle import generated_images
from giantpipe.data.options import GeneratedImagesDataConfig, SyntheticDataConfig
from giantpipe.runner import train
from giantpipe.runner.build import build_experiment
from giantpipe.runner.evaluate import evaluate
from giantpipe.runner.losses import count_top_k
from giantpipe.runner.run_state.init_from import load_initial_weights, read_weights
from models.options import AmoebaNetModelConfig, MlpModelConfig

pytestmark = pytest.mark.slow  # two training runs each (fine-tuning from a run)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def amoeba(classes: int, **trainer) -> ExperimentConfig:
    return ExperimentConfig(
        name="amoeba",
        model=AmoebaNetModelConfig(num_layers=3, num_filters=8, num_classes=classes, image_size=32),
        data=GeneratedImagesDataConfig(
            image_size=32, num_classes=classes, train_size=32, eval_size=16, batch_size=8
        ),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2, deferred_batch_norm=True),
        trainer=TrainerConfig(**{"max_steps": 2, "eval_every": 0, "log_every": 1, **trainer}),
        logger=LoggerConfig(progress="none"),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of a 2-step run on 10 classes, with an EMA of the weights."""
    run_dir = tmp_path_factory.mktemp("pretrain")
    train(amoeba(10, ema_decay=0.5), run_dir, "name: amoeba\n")
    return run_dir / "last"


def test_count_top_k() -> None:
    output = torch.tensor([[0.1, 0.5, 0.4], [0.8, 0.05, 0.15], [0.2, 0.3, 0.5]])
    target = torch.tensor([2, 1, 0])
    assert count_top_k(output, target, 1, None) == 0
    assert count_top_k(output, target, 2, None) == 1
    assert count_top_k(output, target, 5, None) == 3  # k capped at the 3 classes
    assert count_top_k(output, target, 5, ignore_index=0) == 2


def test_top5_bundle_reports_top1_and_top5() -> None:
    bundle = generated_images(32, num_classes=10, train_size=16, eval_size=40, batch_size=8)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    figures = evaluate(model, bundle, None, "fp32", ["cpu"])
    assert set(figures) == {"loss", "accuracy", "top5"}
    assert 0.0 <= figures["accuracy"] <= figures["top5"] <= 1.0


def test_init_from_loads_all_but_the_new_classifier(checkpoint: Path) -> None:
    parts = build_experiment(amoeba(3))
    fresh_fc = parts.pipe.state_dict()["classifier.fc.weight"].clone()
    fresh = load_initial_weights(parts, checkpoint)
    assert fresh == ["classifier.fc.bias", "classifier.fc.weight"]
    state, saved = parts.pipe.state_dict(), read_checkpoint(checkpoint)
    # Parameters come from the EMA (the weights the run evaluated), buffers from the model.
    assert torch.equal(state["stem.conv.weight"], saved["ema"]["stem.conv.weight"])
    assert not torch.equal(saved["ema"]["stem.conv.weight"], saved["model"]["stem.conv.weight"])
    assert torch.equal(state["stem.bn.running_mean"], saved["model"]["stem.bn.running_mean"])
    assert torch.equal(state["classifier.fc.weight"], fresh_fc)


def test_init_from_runs_a_fresh_run_with_another_class_count(checkpoint: Path, tmp_path: Path):
    summary = train(amoeba(3, init_from=str(checkpoint)), tmp_path, "name: amoeba\n")
    assert summary["status"] == "completed" and summary["steps"] == 2  # steps start from 0
    assert read_checkpoint(tmp_path / "last")["model"]["classifier.fc.weight"].shape == (
        3,
        16 * 8,
    )  # 16 D features


def test_init_from_without_a_match_is_one_line(tmp_path: Path, checkpoint: Path) -> None:
    mlp = ExperimentConfig(
        model=MlpModelConfig(in_features=8, hidden=16, depth=2, classes=4),
        data=SyntheticDataConfig(features=8, classes=4, train_size=64, batch_size=16),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        trainer=TrainerConfig(max_steps=1, init_from=str(checkpoint)),
        logger=LoggerConfig(progress="none"),
    )
    with pytest.raises(ConfigError, match=r"trainer.init_from: .* has no tensor matching"):
        train(mlp, tmp_path, "")
    assert not (tmp_path / "config.yaml").exists()  # nothing written before the check
    with pytest.raises(ConfigError, match="trainer.init_from: .*missing.pt does not exist"):
        read_weights(tmp_path / "missing.pt")
