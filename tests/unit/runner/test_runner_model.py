"""The model from its config (runner/model.py): built on meta, each layer filled by the model's
own init under (trainer.seed, layer), so a run starts from the same weights whatever its layout;
a model that cannot be built on meta, or whose init misses a parameter, names
``pipeline.build``, and ``pipeline.build=host`` builds it as its constructor does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    PipelineConfig,
    TrainerConfig,
)
from giantpipe.data.options import LMTokensDataConfig, SyntheticDataConfig
from giantpipe.engine.meta import allocate_layers
from giantpipe.runner import train
from giantpipe.runner.build import build_bundle, build_experiment
from giantpipe.runner.model import build_model
from giantpipe.testing.reference import plain_model
from models.options import HfCausalLmModelConfig, MlpModelConfig, TransformerLMModelConfig

SEED = 3


def mlp(**pipeline: object) -> ExperimentConfig:
    return ExperimentConfig(
        model=MlpModelConfig(in_features=8, hidden=16, depth=5, classes=4, norm="batch"),
        data=SyntheticDataConfig(features=8, classes=4, train_size=64, eval_size=16, batch_size=8),
        pipeline=PipelineConfig(**{"devices": "cpu", "chunks": 4, **pipeline}),
        trainer=TrainerConfig(max_steps=1, seed=SEED),
        logger=LoggerConfig(progress="none"),
    )


LAYOUTS = [
    {"num_devices": 1},
    {"num_devices": 2, "schedule": "1f1b"},
    {"num_devices": 2, "balance": [1, 2, 2, 1], "schedule": "interleaved"},
    {"num_devices": 4, "balance": "time"},
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_run_starts_from_the_same_weights_whatever_its_layout(layout: dict) -> None:
    cfg = mlp(**layout)
    parts = build_experiment(cfg)
    want = plain_model(cfg).state_dict()
    got = parts.pipe.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert parts.model is not None and parts.model[0][0].weight is parts.names["0.0.weight"]
    parts.pipe.close()


def real(cfg: ExperimentConfig, bundle: object = None) -> nn.Sequential:
    model = build_model(cfg, bundle)  # type: ignore[arg-type]
    assert all(p.is_meta for p in model.layers.parameters())  # nothing allocated yet
    assert model.init is not None
    allocate_layers(model.layers, range(len(model.layers)), torch.device("cpu"), model.init)
    return model.layers


def test_the_transformer_keeps_its_own_init() -> None:
    d = 64
    cfg = ExperimentConfig(
        model=TransformerLMModelConfig(
            num_layers=2,
            d_model=d,
            ffn_dim=128,
            num_heads=4,
            vocab_size=500,
            max_len=32,
            ffn_init_scale="sqrt",
        ),  # fmt: skip
        data=SyntheticDataConfig(),
        trainer=TrainerConfig(seed=SEED),
    )
    layers = real(cfg)
    embed = layers[0].tokens.weight
    assert embed.std().item() == pytest.approx(d**-0.5, rel=0.1)  # N(0, D^-1/2), not N(0, 1)
    linears = [m for m in layers[1].modules() if isinstance(m, nn.Linear)]
    assert linears and not any(m.bias.any() for m in linears if m.bias is not None)  # zeros
    ffn = layers[1].ffn.fc1.weight
    xavier = math.sqrt(6 / sum(ffn.shape))
    assert ffn.abs().max().item() <= xavier / 2  # Xavier, scaled by 1/sqrt(2L) = 1/2
    assert ffn.abs().max().item() > 0.9 * xavier / 2
    head = layers[-1].proj.weight
    assert head.std().item() == pytest.approx(d**-0.5, rel=0.1)  # the untied softmax too


def test_a_hugging_face_model_keeps_its_own_init() -> None:
    pytest.importorskip("transformers")
    cfg = ExperimentConfig(
        model=HfCausalLmModelConfig(layers=2, width=64, heads=4, vocab_size=128, max_len=32),
        data=LMTokensDataConfig(vocab_size=128, seq_len=16, batch_size=4, batches_per_epoch=2),
        trainer=TrainerConfig(seed=SEED),
    )
    layers = real(cfg, build_bundle(cfg, None))
    named = dict(layers.named_parameters())
    q = named["1.model.layers.0.self_attn.q_proj.weight"]
    assert q.std().item() == pytest.approx(0.02, rel=0.1)  # initializer_range, not kaiming
    assert torch.equal(named["1.model.layers.0.input_layernorm.weight"], torch.ones(64))
    assert named["0.model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def user_model(target: str, build: str = "meta") -> ExperimentConfig:
    cfg = mlp(num_devices=2, build=build)
    cfg.model = {"_target_": f"tests.unit.runner.meta_models.{target}"}
    return cfg


def test_a_model_that_cannot_be_built_on_meta_names_pipeline_build(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^pipeline.build: the model cannot be built without"):
        train(user_model("item_in_init"), tmp_path, "")
    assert not (tmp_path / "config.yaml").exists()  # nothing written before the check
    summary = train(user_model("item_in_init", build="host"), tmp_path / "host", "")
    assert summary["status"] == "completed"


def test_a_parameter_no_init_reaches_names_pipeline_build(tmp_path: Path) -> None:
    message = r"^pipeline.build: layer 1 \(Gain\): its init leaves gain without a value"
    with pytest.raises(ConfigError, match=message):
        train(user_model("unreached_parameter"), tmp_path, "")
    assert not (tmp_path / "config.yaml").exists()
    summary = train(user_model("unreached_parameter", build="host"), tmp_path / "host", "")
    assert summary["status"] == "completed"


def test_the_build_key_is_checked_before_torch() -> None:
    with pytest.raises(ConfigError, match="^pipeline.build: must be one of meta, host"):
        PipelineConfig(build="disk")
