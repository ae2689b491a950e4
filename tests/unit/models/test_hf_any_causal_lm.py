"""model=hf_causal_lm takes any model type AutoModelForCausalLM builds from a config (GPT-NeoX,
Phi, Gemma, Mixtral, ...; tiny configs, nothing downloaded), with further config keys passed
through; each is captured and pipelined equal to the original (loss, every gradient by the
model's own names); an unknown type is refused by name."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from giantpipe import GPipe, sequentialize
from giantpipe.config import ExperimentConfig, LoggerConfig, PipelineConfig, TrainerConfig
from giantpipe.data.options import LMTokensDataConfig
from giantpipe.runner import train

pytest.importorskip("transformers")
from models.hf import hf_causal_lm  # noqa: E402
from models.options import HfCausalLmModelConfig, causal_lm_types  # noqa: E402

VOCAB, BATCH, T = 64, 8, 8
TINY = {"layers": 2, "width": 32, "heads": 4, "vocab_size": VOCAB, "max_len": 32}
# the MoE: four experts of which each token takes two
CASES = {
    "gpt_neox": {"use_parallel_residual": False},
    "phi": {},
    "gemma": {},
    "mixtral": {"num_local_experts": 4},
}


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_config_keys_pass_through_and_sizes_follow_each_types_names() -> None:
    neox = hf_causal_lm("gpt_neox", **TINY, config={"use_parallel_residual": False})
    assert (neox.config.use_parallel_residual, neox.config.num_hidden_layers) == (False, 2)
    gemma = hf_causal_lm("gemma", **TINY, kv_heads=2)
    assert (gemma.config.head_dim, gemma.config.num_key_value_heads) == (8, 2)  # not 256
    gpt2 = hf_causal_lm("gpt2", **TINY, ffn=48)
    assert (gpt2.config.n_layer, gpt2.config.n_inner) == (2, 48)


def test_an_unknown_type_is_refused_by_name() -> None:
    assert {"llama", "gpt_neox", "phi", "gemma", "mixtral"} <= set(causal_lm_types())
    with pytest.raises(ValueError, match="^model.architecture: 'gpt_nope' is not a model type"):
        HfCausalLmModelConfig(architecture="gpt_nope").check_installed()
    HfCausalLmModelConfig(
        architecture="gpt_neox", config={"use_parallel_residual": False}
    ).check_installed()  # accepted


@pytest.mark.slow
@pytest.mark.parametrize("architecture", list(CASES))
def test_any_causal_lm_pipelined_equals_the_original(architecture: str) -> None:
    model = hf_causal_lm(architecture, **TINY, config=CASES[architecture])
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, VOCAB, (2, BATCH, T), generator=g)
    seq = sequentialize(model, input_ids=ids[:2], output="logits")
    assert len(seq) == 4  # embeddings, 2 decoder layers, head
    plain = copy.deepcopy(model)
    losses = [
        token_loss(plain(input_ids=x).logits, y) for x, y in zip(ids.chunk(2), labels.chunk(2))
    ]
    (sum(losses) / 2).backward()
    pipe = GPipe(copy.deepcopy(seq), [2, 2], devices=["cpu", "cpu"], chunks=2)
    loss = pipe.train_step(ids, labels, token_loss)
    torch.testing.assert_close(loss, sum(losses).detach() / 2, rtol=1e-6, atol=0)
    mine = dict(pipe.state_dict(keep_vars=True))
    for name, p in plain.named_parameters():
        if p.grad is not None:  # a MoE expert no token chose has none, in both
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    pipe.close()


@pytest.mark.slow
def test_the_runner_trains_gpt_neox(tmp_path: Path) -> None:
    cfg = ExperimentConfig(
        name="neox",
        model=HfCausalLmModelConfig(
            architecture="gpt_neox", **TINY, config={"use_parallel_residual": False}
        ),
        data=LMTokensDataConfig(vocab_size=VOCAB, seq_len=T, batch_size=8, batches_per_epoch=4),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        trainer=TrainerConfig(max_steps=2, eval_every=2, log_every=1, predict=False),
        logger=LoggerConfig(progress="none"),
    )
    summary = train(cfg, tmp_path, "name: neox\n")
    assert summary["status"] == "completed" and summary["train/loss"] > 0
