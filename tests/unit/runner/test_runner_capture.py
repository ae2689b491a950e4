"""The runner trains models that are not a flat Sequential: model=hf_causal_lm (a Hugging Face
Llama or GPT-2 on data=lm_tokens) and model=torchvision (on the image data), captured by
giantpipe.sequentialize on a sample batch; checkpoints keep the model's own parameter names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.export import consolidate
from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    PipelineConfig,
)
from giantpipe.data.options import RandomImagesDataConfig, SyntheticDataConfig
from giantpipe.engine.capture import Sequentialized
from giantpipe.runner import model as runner_model
from giantpipe.runner import train
from giantpipe.runner.build import build_bundle, build_experiment
from giantpipe.runner.model import build_model
from models.options import MlpModelConfig, TorchvisionModelConfig

pytest.importorskip("transformers")
from models.hf import hf_causal_lm  # noqa: E402
from tests.support.runs import llama_config  # noqa: E402

pytestmark = pytest.mark.slow  # trains Hugging Face and torchvision models through the runner


def layers_of(cfg: ExperimentConfig) -> torch.nn.Sequential:
    return build_model(cfg, build_bundle(cfg, None)).layers


def test_a_hugging_face_llama_trains_and_its_checkpoint_loads_into_the_plain_model(tmp_path: Path):
    summary = train(llama_config(), tmp_path, "name: llama\n")
    assert summary["status"] == "completed" and summary["train/tokens_per_s"] > 0
    consolidate(tmp_path / "last", tmp_path / "model.pt")
    plain = hf_causal_lm("llama", layers=2, width=32, heads=4, kv_heads=2, vocab_size=64)
    state = torch.load(tmp_path / "model.pt")
    plain.load_state_dict(state, strict=True)  # the model's own names, every one of them
    assert not torch.equal(plain.lm_head.weight, hf_causal_lm("llama", 2, 32, 4, 64).lm_head.weight)


def test_pieces_at_decoder_layers_or_at_split_points():
    parts = build_experiment(llama_config(balance=[3, 1]))
    assert isinstance(parts.model, Sequentialized) and len(parts.model) == 4  # embed, 2, head
    assert "model.layers.0.self_attn.q_proj.weight" in parts.names
    cut = layers_of(llama_config(split_points=["model.layers.1"]))
    assert len(cut) == 2


def test_a_torchvision_model_by_name_on_image_data():
    cfg = ExperimentConfig(
        name="resnet",
        model=TorchvisionModelConfig(name="resnet18", num_classes=10, image_size=32),
        data=RandomImagesDataConfig(image_size=32, num_classes=10, batch_size=8, epoch_size=64),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        logger=LoggerConfig(progress="none"),
    )
    parts = build_experiment(cfg)
    assert len(parts.model) == 10 and sum(parts.spec.balance) == 10  # stem, 8 blocks, head
    x, y = next(parts.bundle.train_batches(0, 0))
    assert parts.pipe.train_step(x, y, parts.loss_fn).item() > 0


@pytest.mark.parametrize(
    ("pipeline", "key"),
    [
        ({"split_points": ["model.layers.7"]}, "pipeline.split_points: sequentialize: split point"),
        ({"output": "hidden"}, "pipeline.output: sequentialize: the model's output has no field"),
    ],
)
def test_capture_problems_name_the_key(pipeline, key):
    with pytest.raises(ConfigError, match=key):
        layers_of(llama_config(**pipeline))


def test_split_points_of_a_flat_sequential_are_refused():
    cfg = ExperimentConfig(
        model=MlpModelConfig(),
        data=SyntheticDataConfig(),
        pipeline=PipelineConfig(split_points=["0"]),
    )
    with pytest.raises(ConfigError, match="pipeline.split_points: the model is a flat"):
        layers_of(cfg)


def test_split_points_must_be_a_list_of_names():
    with pytest.raises(ConfigError, match="pipeline.split_points: must be null or a list"):
        PipelineConfig(split_points="model.layers.1")


@pytest.mark.parametrize(("data", "dynamic"), [("images", "batch"), ("tokens", "all")])
def test_data_of_one_shape_captures_only_the_batch_dimension(data, dynamic, monkeypatch):
    """Images are captured with fixed sizes (Swin-T: 5 CPU s instead of 122); token data keeps
    its length symbolic (generation grows it)."""
    seen = []
    real = runner_model.sequentialize
    monkeypatch.setattr(
        runner_model, "sequentialize", lambda *a, **k: seen.append(k["dynamic"]) or real(*a, **k)
    )
    if data == "images":
        cfg = ExperimentConfig(
            name="resnet",
            model=TorchvisionModelConfig(name="resnet18", num_classes=10, image_size=32),
            data=RandomImagesDataConfig(image_size=32, num_classes=10, batch_size=8, epoch_size=8),
            pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        )
    else:
        cfg = llama_config()
    layers_of(cfg)
    assert seen == [dynamic]
