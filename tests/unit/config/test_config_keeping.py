"""The keys of checkpoint retention, early stopping and callbacks: every bad value refused in
one line naming its key, and the monitored figure resolved from trainer.monitor or the sweep."""

import pytest

from giantpipe.config import ConfigError, ExperimentConfig, SweepConfig, TrainerConfig
from giantpipe.config.trainer import monitored
from giantpipe.data.options import SyntheticDataConfig
from models.options import MlpModelConfig


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ({"keep_last": 0, "checkpoint_every": 5}, "trainer.keep_last: must be >= 1, got 0"),
        (
            {"keep_last": 2},
            "trainer.keep_last: keeps the newest step_N/ that trainer.checkpoint_every writes, "
            "and that is 0 (none are written); set trainer.checkpoint_every",
        ),
        ({"keep_best": -1}, "trainer.keep_best: must be >= 0, got -1"),
        (
            {"monitor": "train/loss"},
            "trainer.monitor: must name an eval figure, e.g. eval/loss or eval/accuracy; got "
            "'train/loss'",
        ),
        ({"monitor_mode": "up"}, "trainer.monitor_mode: must be one of min, max; got 'up'"),
        ({"early_stop_patience": 0}, "trainer.early_stop_patience: must be >= 1, got 0"),
        (
            {"early_stop_patience": 3, "eval_every": 0},
            "trainer.early_stop_patience: counts the evaluations every trainer.eval_every "
            "steps, and that is 0 (only the final one); set trainer.eval_every",
        ),
        (
            {"early_stop_min_delta": -0.1},
            "trainer.early_stop_min_delta: must be >= 0.0, got -0.1",
        ),
        (
            {"early_stop_min_delta": float("nan")},
            "trainer.early_stop_min_delta: must be a finite number, got nan",
        ),
        (
            {"callbacks": {"_target_": "a.B"}},
            "trainer.callbacks: must be a list, e.g. [{_target_: mypkg.MyCallback}]; got "
            "{'_target_': 'a.B'}",
        ),
        (
            {"callbacks": ["a.B"]},
            "trainer.callbacks[0]: must be a mapping with a _target_, e.g. {_target_: "
            "mypkg.MyCallback}; got 'a.B'",
        ),
        (
            {"callbacks": [{"_target_": "a.B"}, {"every": 2}]},
            "trainer.callbacks[1]._target_: missing: name your callback's class, e.g. "
            "{_target_: mypkg.MyCallback}",
        ),
        (
            {"callbacks": [{"_target_": "B"}]},
            "trainer.callbacks[0]._target_: must be a dotted path like mypkg.MyCallback; got 'B'",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(values, line):
    with pytest.raises(ConfigError) as caught:
        TrainerConfig(**values)
    assert str(caught.value) == line


def test_good_values_pass():
    TrainerConfig(checkpoint_every=5, keep_last=1, keep_best=2, early_stop_patience=1)
    TrainerConfig(callbacks=[{"_target_": "mypkg.MyCallback", "every": 2}])


def experiment(sweep: SweepConfig, **trainer) -> ExperimentConfig:
    return ExperimentConfig(
        model=MlpModelConfig(),
        data=SyntheticDataConfig(),
        trainer=TrainerConfig(**trainer),
        sweep=sweep,
    )


@pytest.mark.parametrize(
    ("trainer", "sweep", "expected"),
    [
        ({}, SweepConfig(), ("eval/loss", "min")),
        ({}, SweepConfig("eval/accuracy", "maximize"), ("eval/accuracy", "max")),
        ({"monitor_mode": "max"}, SweepConfig(), ("eval/loss", "max")),
        ({"monitor": "eval/loss"}, SweepConfig(), ("eval/loss", "min")),
        (
            {"monitor": "eval/accuracy", "monitor_mode": "max"},
            SweepConfig(),
            ("eval/accuracy", "max"),
        ),
    ],
)
def test_the_monitor_is_trainer_monitor_or_the_sweep_objective(trainer, sweep, expected):
    assert monitored(TrainerConfig(**trainer), sweep) == expected


@pytest.mark.parametrize(
    ("trainer", "sweep", "line"),
    [
        (
            {"keep_best": 1, "monitor": "eval/accuracy"},
            SweepConfig(),
            "trainer.monitor_mode: say which way eval/accuracy improves: "
            "trainer.monitor_mode=min or trainer.monitor_mode=max",
        ),
        (
            {"early_stop_patience": 2},
            SweepConfig("train/samples_per_s", "maximize"),
            "trainer.monitor: keep_best and early stopping watch an eval figure, and "
            "sweep.objective is 'train/samples_per_s'; set trainer.monitor, e.g. "
            "trainer.monitor=eval/loss",
        ),
    ],
)
def test_an_experiment_that_watches_needs_an_eval_figure_and_its_direction(trainer, sweep, line):
    with pytest.raises(ConfigError) as caught:
        experiment(sweep, **trainer)
    assert str(caught.value) == line
    experiment(sweep, **{k: v for k, v in trainer.items() if k == "monitor"})  # nothing watches
