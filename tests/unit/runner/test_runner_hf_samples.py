"""``model=hf_causal_lm data=lm_tokens data.eval_samples=N``: the runner captures a Hugging Face
Llama / GPT-2, gives its pieces key/value caches (models.hf), trains, and continues the fixed
held-out prompts through the pipe at every evaluation: the samples it logs are the trained
plain model's own greedy continuations, decoded without a cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.export import consolidate
from giantpipe.config import ExperimentConfig, LoggerConfig, PipelineConfig, TrainerConfig
from giantpipe.data.lm_tokens import lm_tokens
from giantpipe.data.options import LMTokensDataConfig
from giantpipe.runner import train

pytest.importorskip("transformers")
from models.hf import hf_causal_lm  # noqa: E402
from models.options import HfCausalLmModelConfig  # noqa: E402

pytestmark = pytest.mark.slow  # trains Hugging Face models through the runner

DATA = {"vocab_size": 64, "seq_len": 16, "batch_size": 8, "batches_per_epoch": 10}
SIZES = {"layers": 2, "width": 32, "heads": 4, "vocab_size": 64}


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_a_hugging_face_lm_trains_and_logs_the_plain_models_samples(
    tmp_path: Path, architecture: str
) -> None:
    cfg = ExperimentConfig(
        name=architecture,
        model=HfCausalLmModelConfig(architecture=architecture, **SIZES),
        data=LMTokensDataConfig(**DATA, eval_samples=2),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        trainer=TrainerConfig(max_steps=2, eval_every=2, log_every=1, checkpoint_every=2),
        logger=LoggerConfig(progress="none"),
    )
    summary = train(cfg, tmp_path, f"name: {architecture}\n")
    assert summary["status"] == "completed" and 0 <= summary["eval/sample_valid"] <= 1
    consolidate(tmp_path / "last", tmp_path / "model.pt")
    plain = hf_causal_lm(architecture, **SIZES).eval()
    plain.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
    hook = lm_tokens(**DATA, eval_samples=2).evaluate_model
    assert hook is not None
    prefix = hook.prompts
    with torch.no_grad():  # uncached: the full forward over the whole prefix, every step
        for _ in range(hook.length):
            step = plain(input_ids=prefix).logits[:, -1].argmax(-1, keepdim=True)
            prefix = torch.cat([prefix, step], dim=1)
    lines = [
        " ".join(map(str, row[: hook.prompts.shape[1]]))
        + " -> "
        + " ".join(map(str, row[hook.prompts.shape[1] :]))
        for row in prefix.tolist()
    ]
    assert summary["eval/samples"] == " | ".join(lines)
