"""trainer.init_from by share: each stage's tensors found by name in the file and only the
matching ones read; a file lacking a stage's tensors refused naming it; a Hugging Face folder
loads into a captured model as from_pretrained would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, LoggerConfig, PipelineConfig
from giantpipe.data.options import LMTokensDataConfig
from giantpipe.engine import GPipe
from giantpipe.runner.build import build_experiment
from giantpipe.runner.run_state.init_from import load_initial_weights, read_share, stage_names


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8))


def test_stage_names_are_each_stages_own_unpartitioned_names() -> None:
    pipe = GPipe(mlp(), [2, 2], devices=["cpu", "cpu"])
    assert stage_names(pipe) == {
        0: ["0.weight", "0.bias"],
        1: [
            "2.weight",
            "2.bias",
            "3.weight",
            "3.bias",
            "3.running_mean",
            "3.running_var",
            "3.num_batches_tracked",
        ],
    }


def test_only_matching_tensors_are_read_and_a_missing_stage_is_refused(tmp_path: Path) -> None:
    pipe = GPipe(mlp(), [2, 2], devices=["cpu", "cpu"])
    live, stages = pipe.state_dict(), stage_names(pipe)
    saved = {k: torch.full_like(v, 7) for k, v in live.items()}
    saved["2.weight"] = torch.zeros(3, 3)  # another shape: left fresh (a new classifier)
    torch.save(saved, tmp_path / "all.pt")
    found = read_share(tmp_path / "all.pt", live, stages)
    assert set(found) == set(live) - {"2.weight"}
    assert all(torch.equal(found[k], saved[k]) for k in found)
    torch.save({k: saved[k] for k in stages[0]}, tmp_path / "half.pt")  # stage 1 cut off
    with pytest.raises(
        ConfigError,
        match=r"^trainer.init_from: .*half.pt has no tensor of stage 1 \(2.weight, 2.bias, 3",
    ):
        read_share(tmp_path / "half.pt", live, stages)


@pytest.mark.slow  # captures a Hugging Face model
def test_a_hugging_face_folder_loads_into_a_captured_llama(tmp_path: Path) -> None:
    from models.hf import hf_causal_lm
    from models.options import HfCausalLmModelConfig

    sizes = {"layers": 2, "width": 32, "heads": 4, "kv_heads": 2, "vocab_size": 64}
    pretrained = hf_causal_lm("llama", **sizes, seed=7)  # not the run's own initialization
    pretrained.save_pretrained(tmp_path / "llama", max_shard_size="40KB")
    cfg = ExperimentConfig(
        model=HfCausalLmModelConfig(**sizes),
        data=LMTokensDataConfig(vocab_size=64, seq_len=16, batch_size=8, batches_per_epoch=10),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        logger=LoggerConfig(progress="none"),
    )
    parts = build_experiment(cfg)
    assert load_initial_weights(parts, tmp_path / "llama") == []
    loaded = parts.pipe.state_dict()
    for name, tensor in pretrained.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
