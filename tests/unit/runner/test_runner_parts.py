"""Small parts: _target_ registry, losses and accuracy, EMA, optimizers, seeding."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from giantpipe.config import ConfigError, OptimConfig
from giantpipe.runner.ema import WeightEMA
from giantpipe.runner.losses import build_loss, count_correct
from giantpipe.runner.optim import build_optimizer
from giantpipe.runner.registry import build_from_target, locate
from giantpipe.runner.seeding import restore_rng, rng_state, seed_everything
from models.options import MlpModelConfig


def test_target_from_schema_or_mapping():
    a = build_from_target(MlpModelConfig(depth=2), "model")
    b = build_from_target({"_target_": "models.mlp.mlp", "depth": 2}, "model")
    assert len(a) == len(b) == 3


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"_target_": "nomodule.fn"}, "model._target_: cannot import 'nomodule'"),
        ({"_target_": "models.mlp.nothing"}, "model._target_: 'models.mlp' has no callable"),
        ({"_target_": "mlp"}, "model._target_: 'mlp' is not a dotted path"),
        ({"_target_": "models.mlp.mlp", "width": 3}, "model: does not fit mlp"),
    ],
)
def test_bad_targets_name_the_key(spec, match):
    with pytest.raises(ConfigError, match=match):
        build_from_target(spec, "model")


def test_locate_returns_the_callable():
    assert locate("torch.nn.functional.relu", "x") is F.relu


def test_cross_entropy_with_label_smoothing_and_ignore_index():
    out, tgt = torch.randn(2, 3, 7), torch.tensor([[1, 2, 0], [0, 5, 6]])
    loss = build_loss("cross_entropy", 0.1, 0, summed=True)(out, tgt)
    ref = F.cross_entropy(
        out.reshape(-1, 7), tgt.reshape(-1), label_smoothing=0.1, ignore_index=0, reduction="sum"
    )
    torch.testing.assert_close(loss, ref)
    assert count_correct(out, tgt, ignore_index=0)[1] == 4


def test_mse_mean():
    out, tgt = torch.randn(4, 2), torch.randn(4, 2)
    torch.testing.assert_close(build_loss("mse", 0.0, None, False)(out, tgt), F.mse_loss(out, tgt))


def test_ema_update_and_swap():
    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(0.0)
    ema = WeightEMA(dict(layer.named_parameters()), decay=0.5)
    with torch.no_grad():
        layer.weight.fill_(4.0)
    ema.update()  # 0.5 * 0 + 0.5 * 4
    with ema.swapped():
        assert layer.weight.item() == 2.0
    assert layer.weight.item() == 4.0
    assert ema.state_dict()["weight"].item() == 2.0


@pytest.mark.parametrize(
    ("cfg", "cls", "check"),
    [
        (
            OptimConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True),
            torch.optim.SGD,
            {"nesterov": True, "momentum": 0.9},
        ),
        (OptimConfig(name="adamw", weight_decay=0.1), torch.optim.AdamW, {"weight_decay": 0.1}),
        (OptimConfig(name="adam", betas=[0.8, 0.9]), torch.optim.Adam, {"betas": (0.8, 0.9)}),
        (
            OptimConfig(name="rmsprop", alpha=0.9, momentum=0.9, eps=1.0),
            torch.optim.RMSprop,
            {"alpha": 0.9, "momentum": 0.9, "eps": 1.0},
        ),
    ],
)
def test_optimizers(cfg, cls, check):
    opt = build_optimizer(nn.Linear(2, 2).parameters(), cfg)
    assert isinstance(opt, cls)
    assert {k: opt.defaults[k] for k in check} == check


def test_rng_state_round_trip():
    seed_everything(3)
    state = rng_state()
    first = (random.random(), torch.rand(2))
    restore_rng(state)
    second = (random.random(), torch.rand(2))
    assert first[0] == second[0] and torch.equal(first[1], second[1])
