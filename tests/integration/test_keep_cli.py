"""``python train.py`` refuses a bad value of checkpoint retention, early stopping or callbacks
in one line naming the key, exit 2, before torch is imported and with nothing written."""

import dataclasses
from pathlib import Path

import pytest

from giantpipe.config import TrainerConfig
from tests.support.train import HEAVY, error_lines, imported, train


# Every bad value has its exact line in tests/unit/config/test_config_keeping.py; here, one of
# each kind goes through the command line (each command costs the everyday lane a process).
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["trainer.keep_last=2"], "trainer.keep_last: keeps the newest step_N/ that trainer."),
        (
            ["trainer.keep_best=1", "trainer.monitor=eval/accuracy"],
            "trainer.monitor_mode: say which way eval/accuracy improves",
        ),
        (
            ["trainer.early_stop_patience=2", "trainer.eval_every=0"],
            "trainer.early_stop_patience: counts the evaluations every trainer.eval_every",
        ),
        (["trainer.callbacks=[{every: 2}]"], "trainer.callbacks[0]._target_: missing"),
    ],
)
def test_a_bad_keeping_value_exits_2_naming_its_key(args, expected, tmp_path: Path):
    result = train(*args, cwd=tmp_path, importtime=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert [line[: len(expected) + 7] for line in error_lines(result)] == [f"error: {expected}"]
    assert not imported(result) & set(HEAVY), "the config was checked after importing torch"
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow  # imports torch to find the callback's class
def test_a_callback_that_does_not_import_exits_2_with_nothing_written(tmp_path: Path):
    result = train(
        "recipe=mlp_quickstart", "trainer.callbacks=[{_target_: mypkg.Hook}]", cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert error_lines(result) == [
        "error: trainer.callbacks[0]._target_: cannot import 'mypkg' (No module named 'mypkg')"
    ]
    assert not (tmp_path / "outputs").exists()


KEYS = ("keep_last", "keep_best", "monitor", "monitor_mode", "early_stop_patience")
KEYS += ("early_stop_min_delta", "callbacks")


def test_help_shows_the_keys_of_keeping_and_hooks(tmp_path: Path):
    result = train("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    fields = {f.name for f in dataclasses.fields(TrainerConfig)}
    for key in KEYS:
        assert f"trainer.{key}=" in result.stdout and key in fields, key
    assert "docs/running.md#keeping-checkpoints" in result.stdout
