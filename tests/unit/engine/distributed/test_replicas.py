"""The replica sharding's pure parts: the modes, the FSDP2 units, where each stage is reduced,
the mixed precision policy each run's precision gives, and the config key that chooses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from giantpipe.cli.checks import to_experiment
from giantpipe.cli.registration import register_configs
from giantpipe.config import ConfigError, ExperimentConfig, PipelineConfig
from giantpipe.data.options import SyntheticDataConfig
from giantpipe.engine.distributed.replicas import (
    DEFAULT_REPLICA_SHARDING,
    last_backwards,
    mixed_precision_policy,
    units_of,
)
from giantpipe.engine.meta import build_on_meta, seeded_init
from giantpipe.engine.schedules import build_schedule
from giantpipe.runner import pipeline as runner_pipeline
from giantpipe.runner.build import build_bundle
from giantpipe.runner.losses import build_loss
from giantpipe.runner.model import Model
from giantpipe.runner.world import World
from models.options import MlpModelConfig

CONF = Path(__file__).resolve().parents[4] / "conf"


def test_the_default_is_zero_2_and_the_key_is_checked() -> None:
    # torchtitan's rule under pipelining, and measured faster than full (docs/running.md)
    assert DEFAULT_REPLICA_SHARDING == "grads" == PipelineConfig().replica_sharding
    for mode in ("full", "grads", "none"):
        assert PipelineConfig(replica_sharding=mode).replica_sharding == mode
    with pytest.raises(ConfigError, match=r"pipeline\.replica_sharding: must be one of full"):
        PipelineConfig(replica_sharding="zero3")


def test_the_key_from_the_command_line() -> None:
    register_configs(CONF)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_experiment(compose("config", overrides=["pipeline.replica_sharding=full"]))
    assert cfg.pipeline.replica_sharding == "full"  # not the default


def test_a_unit_per_layer_with_parameters_and_tied_layers_together() -> None:
    embed, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    middle = nn.Linear(4, 4)
    stages = [nn.Sequential(embed, nn.ReLU(), middle), nn.Sequential(nn.Tanh(), head)]
    units = units_of(stages)
    assert [[id(m) for m in u] for u in units] == [[id(embed), id(head)], [id(middle)]]


def test_each_stage_is_reduced_after_its_last_b_or_w() -> None:
    # zb-v, K=2, V=2: worker 0 holds stages 0 and 3; its last W of each stage ends it
    schedule = build_schedule("zb-v", 2, 4, 2)
    actions = schedule.actions[0]
    last = last_backwards(actions)
    assert set(last) == {0, 3}
    for stage, index in last.items():
        assert actions[index].kind == "W" and actions[index].stage == stage
        assert not any(a.stage == stage and a.kind in "BW" for a in actions[index + 1 :])
    # gpipe: the stage's last B is the worker's last action
    gpipe = build_schedule("gpipe", 2, 4).actions[1]
    assert last_backwards(gpipe) == {1: len(gpipe) - 1}


@pytest.mark.parametrize(
    ("precision", "device", "param", "reduce"),
    [
        ("bf16", "cuda:0", torch.bfloat16, torch.float32),
        ("fp16", "cuda:1", torch.float16, torch.float32),
        ("fp32", "cuda:0", None, None),
        ("bf16", "cpu", None, None),
    ],
)
def test_the_precision_gives_fsdp_its_policy_on_gpus(
    precision: str, device: str, param: torch.dtype | None, reduce: torch.dtype | None
) -> None:
    policy = mixed_precision_policy(precision, device)
    assert (policy.param_dtype, policy.reduce_dtype) == (param, reduce)


class TwoRanks(World):
    """Rank 0 of a world of two whose collectives are answered here (every rank alike)."""

    size = 2

    def gather(self, value: Any) -> list[Any]:
        return [value, value]

    def bind(self, pipe: Any) -> None:
        self.bound = pipe


def test_the_runner_passes_the_sharding_and_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def record(model: nn.Module, **kwargs: Any) -> str:
        seen.update(kwargs)
        return "pipe"

    monkeypatch.setattr(runner_pipeline, "DistributedPipe", record)
    monkeypatch.setattr(runner_pipeline.torch.cuda, "device_count", lambda: 2)
    pipeline = PipelineConfig(
        devices=["cuda:1", "cuda:0"], balance=[1, 1], replica_sharding="grads", precision="bf16"
    )
    cfg = ExperimentConfig(model=MlpModelConfig(), pipeline=pipeline, data=SyntheticDataConfig())
    model = Model(build_on_meta(lambda: nn.Sequential(nn.ReLU(), nn.ReLU())), seeded_init(0))
    loss = build_loss("cross_entropy", 0.0, None, summed=False)
    built = runner_pipeline.build_pipeline(cfg, model, build_bundle(cfg, None), loss, TwoRanks())
    assert built.pipe == "pipe" and built.feeds == ("cuda:1", "cuda:1")
    assert seen["replica_sharding"] == "grads" and seen["init"] is model.init
    assert seen["mixed_precision"].param_dtype == torch.bfloat16
    assert seen["mixed_precision"].reduce_dtype == torch.float32
    assert seen["device"] == torch.device("cuda", 1)
