"""The runner makes one PipelineSpec from the config (runner.pipeline.pipeline_spec) and the
schedule is built and validated once before step 1 (it was three times: build.py's check, the
pipe builder's check and the pipe's own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    PipelineConfig,
    TrainerConfig,
)
from giantpipe.data.options import SyntheticDataConfig
from giantpipe.engine import schedules
from giantpipe.engine.spec import PipelineSpec
from giantpipe.runner.build import build_experiment
from giantpipe.runner.pipeline import pipeline_spec
from giantpipe.runner.seeding import seed_everything
from models.options import MlpModelConfig


def tiny(**pipeline: Any) -> ExperimentConfig:
    return ExperimentConfig(
        name="tiny",
        model=MlpModelConfig(in_features=8, hidden=16, depth=3, classes=4),
        data=SyntheticDataConfig(features=8, classes=4, train_size=64, eval_size=16, batch_size=8),
        pipeline=PipelineConfig(**{"devices": "cpu", "num_devices": 2, "chunks": 4, **pipeline}),
        trainer=TrainerConfig(max_steps=1, eval_every=0, predict=False),
        logger=LoggerConfig(progress="none"),
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_schedule_is_built_and_validated_once_before_step_1(
    schedule: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    validated: list[str] = []
    real = schedules.validate

    def counting(built: Any) -> None:
        validated.append(built.name)
        real(built)

    monkeypatch.setattr(schedules, "validate", counting)  # what build_schedule calls
    cfg = tiny(schedule=schedule)
    # the pre-flight sizes candidate specs of its own (tests/unit/runner/test_preflight.py);
    # this test follows the run's one spec from the config to step 1
    cfg.trainer.memory_check = False
    seed_everything(cfg.trainer.seed)
    parts = build_experiment(cfg, tmp_path)
    x, y = next(parts.bundle.train_batches(cfg.trainer.seed, 0))
    parts.pipe.train_step(x, y, parts.loss_fn)  # step 1 builds nothing more
    assert validated == [schedule]
    assert parts.pipe.spec == pipeline_spec(cfg.pipeline, parts.spec.balance, ["cpu", "cpu"])


def test_the_config_becomes_a_spec_in_one_function() -> None:
    cfg = PipelineConfig(chunks=8, recompute="never", schedule="interleaved", virtual_stages=2,
                         timeout=42.0, deferred_batch_norm=True)  # fmt: skip
    spec = pipeline_spec(cfg, [1, 1, 1, 1], ["cpu", "cuda:0", "cuda:1"])
    assert spec == PipelineSpec(
        balance=(1, 1, 1, 1),
        chunks=8,
        schedule="interleaved",
        virtual_stages=2,
        recompute="never",
        devices=("cpu", "cuda:0"),  # the K = 4 / 2 workers' devices
        timeout=42.0,
        deferred_batch_norm=True,
    )


def test_what_the_config_cannot_check_alone_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_spec(PipelineConfig(schedule="interleaved", virtual_stages=2), [1, 1, 1])
    assert info.value.key == "pipeline.virtual_stages"
    with pytest.raises(ConfigError) as info:
        pipeline_spec(PipelineConfig(schedule="interleaved", virtual_stages=2, chunks=3), [1] * 4)
    assert info.value.key == "pipeline.schedule" and "multiple of the number of workers" in str(
        info.value
    )
