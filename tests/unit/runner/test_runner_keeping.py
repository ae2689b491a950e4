"""Checkpoints kept as users keep them, on real runs: keep_last and keep_best (the kept set is
the one the run's own metrics.jsonl implies), early stopping (exit as completed, the reason in
the summary, counted on across a resume), and callbacks named in the config (their calls in
order; one that raises is named in one line and leaves the checkpoints whole)."""

import json
from pathlib import Path
from typing import Any

import pytest

from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from giantpipe.runner.callbacks import Callback, CallbackError, RunInfo
from giantpipe.runner.ledger import LEDGER
from giantpipe.runner.rundir import finished_run
from tests.support.runs import kept_steps, tiny, whole


def evaluations(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"}


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_keep_last_and_keep_best_keep_the_newest_and_the_best(tmp_path: Path, async_save: bool):
    # eval/loss ranked upwards (mode max): the best is an early evaluation between the saves
    # of trainer.checkpoint_every, which keep_best saves as a step_N/ of its own.
    cfg = tiny(
        max_steps=8,
        eval_every=2,
        checkpoint_every=4,
        keep_last=1,
        keep_best=1,
        monitor_mode="max",
        async_save=async_save,
        predict=False,
    )
    summary = train(cfg, tmp_path, "")
    losses = evaluations(tmp_path)
    best = max(losses, key=lambda step: (losses[step], -step))
    assert kept_steps(tmp_path) == sorted({8, best}) and best < 8
    assert [whole(tmp_path / f"step_{s}") for s in sorted({8, best})] == sorted({8, best})
    assert summary["checkpoints/kept"] == {
        f"step_{best}": f"eval/loss {losses[best]:.6g}, the best (trainer.keep_best=1)",
        "step_8": "among the 1 newest (trainer.keep_last)",
    }
    written = 2 + (best % 4 != 0)  # step_4, step_8, and the best between them
    assert summary["checkpoints/removed"] == written - 2
    assert not list(tmp_path.glob("*.removing"))
    ledger = json.loads((tmp_path / LEDGER).read_text())
    assert [step for step, _ in ledger["evaluations"]] == sorted(losses)
    assert ledger["removing"] == []


def test_early_stopping_ends_the_run_as_completed_and_says_why(tmp_path: Path):
    # No evaluation improves eval/loss by 1000: the second after the first stops the run.
    values = {"early_stop_patience": 2, "early_stop_min_delta": 1000.0, "predict": False}
    cfg = tiny(max_steps=40, eval_every=2, **values)
    summary = train(cfg, tmp_path, "")
    losses = evaluations(tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["stopped_early"] == (
        "stopped early at step 6: eval/loss did not improve by 1000 for 2 evaluations "
        f"(best {losses[2]:.6g} at step 2)"
    )
    assert sorted(losses) == [2, 4, 6]  # no second evaluation at the step it stopped
    assert whole(tmp_path / "last") == 6
    assert finished_run("auto", tmp_path, 40)  # trainer.resume=auto leaves it as it is


@pytest.mark.slow  # two runs
def test_a_resumed_run_counts_patience_on_from_its_earlier_evaluations(tmp_path: Path):
    values = {"eval_every": 2, "early_stop_patience": 2, "early_stop_min_delta": 1000.0}
    train(tiny(max_steps=4, predict=False, **values), tmp_path, "")  # evaluations 2 and 4
    cfg = tiny(max_steps=40, resume=True, predict=False, **values)
    summary = train(cfg, tmp_path, "")
    assert summary["steps"] == 6 and summary["stopped_early"].startswith(
        "stopped early at step 6: eval/loss did not improve by 1000 for 2 evaluations"
    )


class Recorder(Callback):
    """Records every call, on every rank, in ``calls`` (or, given a ``name``, in
    RUN/NAME-rankR.jsonl with the rank and the world's size)."""

    every_rank = True
    calls: list[tuple[Any, ...]] = []

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def note(self, run: RunInfo, *call: Any) -> None:
        if self.name is not None:
            with (run.run_dir / f"{self.name}-rank{run.rank}.jsonl").open("a") as handle:
                handle.write(json.dumps([*call, run.rank, run.world_size]) + "\n")
        else:
            Recorder.calls.append(call)

    def after_step(self, run: RunInfo, figures: dict[str, float]) -> None:
        self.note(run, "after_step", run.step, sorted(figures))

    def after_evaluation(self, run: RunInfo, figures: dict[str, float]) -> None:
        self.note(run, "after_evaluation", run.step, sorted(figures))

    def after_save(self, run: RunInfo, directory: Path) -> None:
        assert (directory / "manifest.json").exists()  # committed
        self.note(run, "after_save", run.step, directory.name)

    def at_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        self.note(run, "at_end", run.step, summary["status"])


class RankZeroRecorder(Recorder):
    """The same, on rank 0 only."""

    every_rank = False


class Failing:
    """Raises in its hook at step 3 (on rank ``rank``; every rank calls it)."""

    every_rank = True

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def after_step(self, run: RunInfo, figures: dict[str, float]) -> None:
        if run.step == 3 and run.rank == self.rank:
            raise ValueError("no room on the dashboard")


def test_callbacks_named_in_the_config_hear_every_hook_in_order(tmp_path: Path):
    Recorder.calls.clear()
    cfg = tiny(max_steps=4, eval_every=2, checkpoint_every=4, predict=False)
    cfg.trainer.callbacks = [{"_target_": f"{__name__}.Recorder"}]
    train(cfg, tmp_path, "")
    step = ["train/loss", "train/lr", "train/samples", "train/step_time_s"]
    evaluation = ["eval/accuracy", "eval/loss"]
    assert Recorder.calls == [
        ("after_step", 1, step),
        ("after_step", 2, step),
        ("after_evaluation", 2, evaluation),
        ("after_save", 2, "last"),
        ("after_step", 3, step),
        ("after_step", 4, step),
        ("after_save", 4, "step_4"),
        ("after_save", 4, "last"),
        ("after_evaluation", 4, evaluation),  # the final one
        ("at_end", 4, "completed"),
    ]


def test_a_failing_callback_is_named_in_one_line_and_the_checkpoints_stay_whole(tmp_path: Path):
    Recorder.calls.clear()
    cfg = tiny(max_steps=8, eval_every=2, predict=False)
    cfg.trainer.callbacks = [
        {"_target_": f"{__name__}.Failing"},
        {"_target_": f"{__name__}.Recorder"},
    ]
    with pytest.raises(CallbackError) as caught:
        train(cfg, tmp_path, "")
    line = (
        f"trainer.callbacks[0] ({__name__}.Failing) failed in after_step at step 3: ValueError: "
        f"no room on the dashboard; the run stopped (last good checkpoint: {tmp_path / 'last'} "
        "(step 2)): fix it and resume with trainer.resume=true"
    )
    assert str(caught.value) == line and "\n" not in line
    assert isinstance(caught.value.__cause__, ValueError)  # its traceback goes to error.txt
    assert ("after_step", 3) not in [c[:2] for c in Recorder.calls]  # none after it raised
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == f"CallbackError: {line}"
    assert whole(tmp_path / "last") == 2
