"""Building trainer.callbacks: each mistake refused in one line naming the entry, rank 0 or
every rank as the class declares; a hook that raises is remembered, and no hook runs after it;
a monitored figure the run does not report is refused before anything is written."""

from pathlib import Path
from typing import Any

import pytest

from giantpipe.config import ConfigError
from giantpipe.runner import train
from giantpipe.runner.callbacks import Callback, RunInfo, build_callbacks
from giantpipe.runner.world import World
from tests.support.runs import tiny


class EveryRank(Callback):
    every_rank = True


class RankZero(Callback):
    def __init__(self, label: str = "") -> None:
        self.label = label


class NoHook:
    def summary(self) -> None: ...


class Misspelt:
    def after_eval(self, run: RunInfo, figures: dict[str, float]) -> None: ...


class OddRanks:
    every_rank = "yes"

    def at_end(self, run: RunInfo, summary: dict[str, Any]) -> None: ...


class RankOne(World):
    rank, size = 1, 2


def spec(name: str, **kwargs: Any) -> dict[str, Any]:
    return {"_target_": f"{__name__}.{name}", **kwargs}


@pytest.mark.parametrize(
    ("specs", "line"),
    [
        (
            [{"_target_": "nowhere.Callback"}],
            "trainer.callbacks[0]._target_: cannot import 'nowhere' (No module named 'nowhere')",
        ),
        (
            [spec("RankZero"), spec("RankZero", colour="red")],
            "trainer.callbacks[1]: does not fit RankZero: got an unexpected keyword "
            "argument 'colour'",
        ),
        (
            [spec("NoHook")],
            "trainer.callbacks[0]: NoHook defines none of after_step, after_evaluation, "
            "after_save, at_end",
        ),
        (
            [spec("Misspelt")],
            "trainer.callbacks[0]: after_eval is not a hook (did you mean after_evaluation? the "
            "hooks are after_step, after_evaluation, after_save, at_end)",
        ),
        ([spec("OddRanks")], "trainer.callbacks[0]: every_rank must be True or False, got 'yes'"),
    ],
)
def test_a_callback_that_cannot_be_built_is_one_line_naming_its_entry(specs, line):
    with pytest.raises(ConfigError) as caught:
        build_callbacks(specs, World())
    assert str(caught.value) == line


def test_a_callback_runs_on_rank_0_unless_it_declares_every_rank():
    specs = [spec("RankZero", label="a"), spec("EveryRank")]
    zero, one = build_callbacks(specs, World()), build_callbacks(specs, RankOne())
    assert [type(n.callback).__name__ for n in zero.built] == ["RankZero", "EveryRank"]
    assert [n.label for n in one.built] == [f"trainer.callbacks[1] ({__name__}.EveryRank)"]
    assert zero.configured and one.configured  # both take part in agreeing on a failure
    assert not build_callbacks([], World()).configured


class Raises(Callback):
    def after_step(self, run: RunInfo, figures: dict[str, float]) -> None:
        raise KeyError("train/perplexity")


class Counts(Callback):
    calls = 0

    def after_step(self, run: RunInfo, figures: dict[str, float]) -> None:
        Counts.calls += 1


def test_the_first_hook_that_raises_is_remembered_and_no_hook_runs_after_it(tmp_path: Path):
    Counts.calls = 0
    callbacks = build_callbacks([spec("Counts"), spec("Raises"), spec("Counts")], World())
    run = RunInfo("tiny", tmp_path, 7, 10, 0, 1)
    callbacks.call("after_step", run, {})
    callbacks.call("after_step", run, {})
    assert Counts.calls == 1
    assert callbacks.agreed_failure(World()) == (
        f"trainer.callbacks[1] ({__name__}.Raises) failed in after_step at step 7: KeyError: "
        "'train/perplexity'"
    )
    assert isinstance(callbacks.error, KeyError)


def test_a_monitored_figure_the_run_does_not_report_is_refused_before_anything_is_written(
    tmp_path: Path,
):
    cfg = tiny(keep_best=1, monitor="eval/top5", monitor_mode="max", predict=False)
    with pytest.raises(ConfigError) as caught:
        train(cfg, tmp_path / "run", "")
    assert str(caught.value) == (
        "trainer.monitor: 'eval/top5' (trainer.monitor) is not a figure this run's evaluation "
        "reports; choose one of eval/accuracy, eval/loss"
    )
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []
