"""``PipedModel`` (engine/inference.py), the pipe as its whole model for a data's whole-model
evaluation: its forward through a pipe's stages equals the plain model's, for one stage per
worker and for virtual stages, without gradients and leaving every module's mode as it was; its
generate is the pipe's; a plain model's other attributes are refused, saying what it offers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.generate import Decoding, generate, split_rows
from giantpipe.engine.inference import PipedModel
from models.transformer import transformer_lm


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"balance": [2, 4], "chunks": 3},
        {"balance": [1, 2, 1, 2], "chunks": 2, "schedule": "interleaved", "virtual_stages": 2},
    ],
    ids=["gpipe", "interleaved"],
)
def test_its_forward_equals_the_plain_models_in_eval_mode(kwargs: dict) -> None:
    x = torch.randn(5, 6)
    with torch.no_grad():
        expected = mlp().eval()(x)
    pipe = GPipe(mlp(), devices=["cpu", "cpu"], **kwargs)
    pipe.train()
    pipe[3].eval()  # a module frozen in eval mode stays so; the others go back to training
    out = PipedModel(pipe)(x)  # the dropout is off: eval mode, as a whole-model evaluation
    torch.testing.assert_close(out, expected)  # micro-batches: the same up to rounding
    assert out.grad_fn is None
    assert [m.training for m in pipe] == [True, True, True, False, True, True]


def test_it_generates_through_the_pipe_as_the_engine_does() -> None:
    def lm() -> nn.Sequential:
        torch.manual_seed(3)
        return transformer_lm(2, d_model=16, ffn_dim=32, num_heads=2, vocab_size=23, max_len=32)

    model = PipedModel(GPipe(lm(), balance=[2, 2], devices=["cpu", "cpu"], chunks=2))
    prompts = split_rows(torch.randint(0, 23, (4, 5)), model.chunks)
    got = model.generate(prompts, [6] * model.chunks, Decoding())
    assert got == generate(lm(), prompts, [6, 6], Decoding())
    assert (model.chunks, model.replica, model.replicas) == (2, 0, 1)


def test_a_plain_models_other_attributes_are_refused_saying_what_it_offers() -> None:
    model = PipedModel(nn.Sequential(nn.Linear(2, 2)))
    assert model.chunks == 1
    with pytest.raises(AttributeError, match=r"'encode'.*model\(inputs\), model.generate"):
        model.encode  # noqa: B018 - an encoder-decoder's method, not the pipe's
    assert not hasattr(model, "partitions")
