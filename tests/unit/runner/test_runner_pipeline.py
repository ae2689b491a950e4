"""Devices and balance from PipelineConfig: resolution and rejection before any work."""

import pytest
import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, PipelineConfig
from giantpipe.data.options import SyntheticDataConfig
from giantpipe.engine.meta import build_on_meta, seeded_init
from giantpipe.runner.build import build_bundle
from giantpipe.runner.losses import build_loss
from giantpipe.runner.model import Model
from giantpipe.runner.pipeline import (
    build_pipeline,
    pipeline_spec,
    resolve_balance,
    resolve_devices,
)
from giantpipe.runner.world import World
from models.options import MlpModelConfig


def seq(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def on_meta(n: int) -> Model:
    return Model(build_on_meta(lambda: seq(n)), seeded_init(0))


@pytest.mark.parametrize(
    ("cfg", "cuda", "expected"),
    [
        (PipelineConfig(devices="cpu", num_devices=3), 0, ["cpu"] * 3),
        (PipelineConfig(devices="cpu", balance=[1, 1, 1, 1]), 0, ["cpu"] * 4),
        (PipelineConfig(devices="cpu"), 0, ["cpu", "cpu"]),
        (PipelineConfig(devices="auto"), 0, ["cpu", "cpu"]),
        (PipelineConfig(devices="auto"), 2, ["cuda:0", "cuda:1"]),
        (PipelineConfig(devices="auto", num_devices=1), 4, ["cuda:0"]),
        (PipelineConfig(devices="cuda"), 3, ["cuda:0", "cuda:1", "cuda:2"]),
        (PipelineConfig(devices=["cpu", "cuda:1"]), 2, ["cpu", "cuda:1"]),
        (PipelineConfig(devices=["cpu", "cpu", "cpu"], num_devices=2), 0, ["cpu", "cpu"]),
    ],
)
def test_resolve_devices(cfg, cuda, expected):
    assert resolve_devices(cfg, cuda) == expected


@pytest.mark.parametrize(
    ("cfg", "cuda", "key"),
    [
        (PipelineConfig(devices="cuda"), 0, "pipeline.devices"),
        (PipelineConfig(devices="cuda", num_devices=3), 2, "pipeline.num_devices"),
        (PipelineConfig(devices=["cuda:2"]), 2, "pipeline.devices"),
        (PipelineConfig(devices=["tpu:0"]), 0, "pipeline.devices"),
        (PipelineConfig(devices=["cuda:x"]), 1, "pipeline.devices"),
    ],
)
def test_unusable_devices_are_rejected(cfg, cuda, key):
    with pytest.raises(ConfigError) as info:
        resolve_devices(cfg, cuda)
    assert info.value.key == key


def test_balance_must_cover_the_model_and_fit_the_devices():
    cfg = PipelineConfig(devices="cpu")
    with pytest.raises(ConfigError, match=r"pipeline.balance: \[2, 2\] sums to 4 .* 5 layers"):
        pipeline_spec(cfg, [2, 2], ["cpu"] * 2, num_layers=5)
    with pytest.raises(ConfigError, match="pipeline.balance: 3 stages but only 2 devices"):
        pipeline_spec(cfg, [1, 2, 2], ["cpu"] * 2, num_layers=5)
    pipeline_spec(cfg, [2, 3], ["cpu"] * 2, num_layers=5)


def test_policy_balance_uses_every_device_and_the_engine():
    sample = torch.randn(2, 4)
    for policy in ("params", "time", "memory"):
        cfg = PipelineConfig(devices="cpu", num_devices=2, balance=policy)
        balance = resolve_balance(cfg, on_meta(6), ["cpu", "cpu"], sample)
        assert len(balance) == 2 and sum(balance) == 6


def test_more_stages_than_layers_is_rejected():
    cfg = PipelineConfig(devices="cpu", num_devices=3, balance="params")
    with pytest.raises(ConfigError, match="pipeline.num_devices: 3 stages .* only 2 layers"):
        resolve_balance(cfg, on_meta(2), ["cpu"] * 3, torch.randn(2, 4))


def test_build_pipeline_passes_the_settings_through():
    pipeline = PipelineConfig(
        devices="cpu", num_devices=3, balance=[2, 2], chunks=3, recompute="always"
    )
    cfg = ExperimentConfig(
        model=MlpModelConfig(in_features=4), pipeline=pipeline, data=SyntheticDataConfig(features=4)
    )
    loss = build_loss("cross_entropy", 0.0, None, summed=False)
    built = build_pipeline(cfg, on_meta(4), build_bundle(cfg, None), loss, World())
    pipe = built.pipe
    assert (pipe.balance, pipe.chunks, pipe.recompute, len(pipe.devices)) == (
        [2, 2],
        3,
        "always",
        2,
    )
    assert built.feeds == ("cpu", "cpu") and built.plan_choice is None
    pipe.close()


def test_unknown_schedule_is_rejected_naming_the_key():
    cfg = PipelineConfig(devices="cpu", num_devices=2, schedule="zigzag")
    with pytest.raises(ConfigError, match="pipeline.schedule: unknown schedule 'zigzag'"):
        pipeline_spec(cfg, [2, 2], ["cpu", "cpu"])
