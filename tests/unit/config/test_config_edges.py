"""Issue 22, items 5, 8 and the float "Also": a timeout no worker could wait, nan and inf in any
float setting, and the keys ``trainer.resume_changed`` may name, refused as one line naming the
key, for the right reason, before anything is built."""

import threading
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from giantpipe.cli.checks import check_known_keys, to_experiment
from giantpipe.cli.errors import one_line
from giantpipe.cli.registration import register_configs
from giantpipe.config import MAX_TIMEOUT_S, ConfigError, ExperimentConfig, OptimConfig

CONF = Path(__file__).resolve().parents[3] / "conf"
register_configs(CONF)


def composed(*overrides: str) -> ExperimentConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["recipe=mlp_quickstart", *overrides])
        experiment = to_experiment(cfg)
        check_known_keys(cfg, experiment)
        return experiment


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        composed(*overrides)
    return one_line(caught.value)


@pytest.mark.slow
def test_the_local_timeout_is_capped_like_the_distributed_one():
    """inf or 1e10 used to pass and kill the first step with an OverflowError blamed on stage 1:
    a worker thread cannot wait past threading.TIMEOUT_MAX. nan and negatives are refused too,
    each for what it is."""
    assert MAX_TIMEOUT_S < threading.TIMEOUT_MAX
    assert composed(f"pipeline.timeout={MAX_TIMEOUT_S}").pipeline.timeout == MAX_TIMEOUT_S
    for value, expected in [
        ("1e10", "must be at most 604800 s (a week)"),
        ("inf", "must be a finite number, got inf"),
        ("nan", "must be a finite number, got nan"),
        ("-1", "must be > 0 seconds, got -1.0"),
    ]:
        line = refusal("pipeline.executor=local", f"pipeline.timeout={value}")
        assert line.startswith(f"pipeline.timeout: {expected}"), line


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.weight_decay=nan", "optim.weight_decay: must be a finite number, got nan"),
        ("optim.lr=inf", "optim.lr: must be a finite number, got inf"),
        ("optim.betas=[0.9,nan]", "optim.betas: must hold finite numbers, got [0.9, nan]"),
        ("optim.lr_schedule.min_ratio=nan", "optim.lr_schedule.min_ratio: must be a finite"),
        ("trainer.grad_clip=inf", "trainer.grad_clip: must be a finite number, got inf"),
        ("data.noise=nan", "data.noise: must be a finite number, got nan"),  # a builder's schema
        ("model.dropout=-inf", "model.dropout: must be a finite number, got -inf"),
    ],
)
def test_nan_and_inf_are_refused_as_what_they_are(override: str, expected: str):
    assert refusal(override).startswith(expected)


def test_a_config_built_in_python_is_checked_the_same_way():
    with pytest.raises(ConfigError, match=r"^optim.weight_decay: must be a finite number, got nan"):
        OptimConfig(weight_decay=float("nan"))


def test_resume_changed_names_only_keys_a_resume_checks():
    allowed = composed("trainer.resume_changed=[trainer.seed,data,model.hidden]")
    assert allowed.trainer.resume_changed == ["trainer.seed", "data", "model.hidden"]
    assert refusal("trainer.resume_changed=[optim.lr]") == (
        "trainer.resume_changed: optim.lr is not checked on resume (only trainer.seed, model.* "
        "and data.* are); other keys may change without it"
    )
    assert refusal("trainer.resume_changed=[trainer]").startswith("trainer.resume_changed: ")
