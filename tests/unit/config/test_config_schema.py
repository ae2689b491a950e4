"""Schema checks: every invalid value is rejected with its dotted key in the message."""

import pytest

from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    LRScheduleConfig,
    OptimConfig,
    PipelineConfig,
    SweepConfig,
    TrainerConfig,
)
from giantpipe.data.options import SyntheticDataConfig, TensorDataConfig
from giantpipe.engine.spec import DEFAULT_CHUNKS, DEFAULT_TIMEOUT
from models.options import MlpModelConfig


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: PipelineConfig(chunks=0), "pipeline.chunks"),
        (lambda: PipelineConfig(recompute="sometimes"), "pipeline.recompute"),
        (lambda: PipelineConfig(precision="fp8"), "pipeline.precision"),
        (lambda: PipelineConfig(schedule=""), "pipeline.schedule"),
        (lambda: PipelineConfig(devices="tpu"), "pipeline.devices"),
        (lambda: PipelineConfig(devices=[]), "pipeline.devices"),
        (lambda: PipelineConfig(devices=["cpu"], num_devices=2), "pipeline.num_devices"),
        (lambda: PipelineConfig(num_devices=0), "pipeline.num_devices"),
        (lambda: PipelineConfig(balance="flops"), "pipeline.balance"),
        (lambda: PipelineConfig(balance=[2, 0]), "pipeline.balance"),
        (lambda: PipelineConfig(balance=[]), "pipeline.balance"),
        (lambda: PipelineConfig(executor="mpi"), "pipeline.executor"),
        (lambda: PipelineConfig(executor="distributed", timeout=0), "pipeline.timeout"),
        (lambda: LRScheduleConfig(name="step"), "optim.lr_schedule.name"),
        (
            lambda: LRScheduleConfig(warmup_steps=5, warmup_epochs=1.0),
            "optim.lr_schedule.warmup_epochs",
        ),
        (lambda: LRScheduleConfig(decay_rate=1.5), "optim.lr_schedule.decay_rate"),
        (lambda: LRScheduleConfig(name="exponential"), "optim.lr_schedule.decay_steps"),
        (lambda: LRScheduleConfig(min_ratio=2.0), "optim.lr_schedule.min_ratio"),
        (lambda: OptimConfig(name="lamb"), "optim.name"),
        (lambda: OptimConfig(lr=0.0), "optim.lr"),
        (lambda: OptimConfig(name="sgd", nesterov=True), "optim.nesterov"),
        (lambda: OptimConfig(betas=[0.9]), "optim.betas"),
        (lambda: OptimConfig(alpha=1.0), "optim.alpha"),
        (lambda: TrainerConfig(max_steps=None), "trainer.max_steps"),
        (lambda: TrainerConfig(max_steps=0), "trainer.max_steps"),
        (lambda: TrainerConfig(max_steps=None, max_epochs=-1.0), "trainer.max_epochs"),
        (lambda: TrainerConfig(accumulate=0), "trainer.accumulate"),
        (lambda: TrainerConfig(log_every=0), "trainer.log_every"),
        (lambda: TrainerConfig(resume=""), "trainer.resume"),
        (lambda: TrainerConfig(resume=3), "trainer.resume"),
        (lambda: TrainerConfig(grad_clip=0.0), "trainer.grad_clip"),
        (lambda: TrainerConfig(label_smoothing=1.0), "trainer.label_smoothing"),
        (lambda: TrainerConfig(ema_decay=1.0), "trainer.ema_decay"),
        (lambda: LoggerConfig(progress="rich"), "logger.progress"),
        (lambda: LoggerConfig(wandb_mode="cloud"), "logger.wandb_mode"),
        (lambda: SweepConfig(direction="up"), "sweep.direction"),
        (lambda: SyntheticDataConfig(classes=1), "data.classes"),
        (lambda: SyntheticDataConfig(batch_size=100, train_size=10), "data.batch_size"),
        (lambda: TensorDataConfig(root="x", features=4, classes=2, loss="l1"), "data.loss"),
        (lambda: ExperimentConfig(model={}, data=SyntheticDataConfig()), "model._target_"),
    ],
)
def test_invalid_value_names_its_key(build, key):
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")


def test_defaults_are_valid():
    cfg = ExperimentConfig(model=MlpModelConfig(), data=SyntheticDataConfig())
    assert cfg.pipeline.chunks == DEFAULT_CHUNKS and cfg.trainer.max_steps == 100
    assert cfg.pipeline.timeout == DEFAULT_TIMEOUT  # the engine's own defaults


def test_explicit_devices_and_balance_lists_are_accepted():
    cfg = PipelineConfig(devices=["cpu", "cpu", "cpu"], num_devices=2, balance=[3, 5])
    assert cfg.balance == [3, 5]
