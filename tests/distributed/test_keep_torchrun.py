"""Retention, early stopping and callbacks under torchrun: every rank follows rank 0's verdict
(all stop at the same step, exit 0), rank 0 alone removes, a callback runs on rank 0 or on
every rank as its class declares, and one that raises on rank 1 only stops every rank, named
in one line, with the checkpoints whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.ranks import finish
from tests.support.runs import TORCHRUN_MLP, kept_steps, whole
from tests.support.train import train_under_torchrun

pytestmark = pytest.mark.distributed

KEEPING = [
    "trainer.max_steps=20",
    "trainer.eval_every=2",
    "trainer.checkpoint_every=2",
    "trainer.keep_last=1",
    "trainer.early_stop_patience=2",
    "trainer.early_stop_min_delta=1000",  # no evaluation improves by that: stops at step 6
    "trainer.predict=false",
]
HOOKS = "tests.unit.runner.test_runner_keeping"


def calls(run: Path, name: str) -> dict[int, list[list]]:
    files = sorted(run.glob(f"{name}-rank*.jsonl"))
    return {
        int(path.stem.rsplit("rank", 1)[1]): [json.loads(line) for line in path.open()]
        for path in files
    }


def test_ranks_keep_stop_and_call_back_together(tmp_path: Path) -> None:
    callbacks = (
        f"trainer.callbacks=[{{_target_: {HOOKS}.Recorder, name: every}},"
        f"{{_target_: {HOOKS}.RankZeroRecorder, name: zero}}]"
    )
    code, output = finish(train_under_torchrun(tmp_path, *TORCHRUN_MLP, *KEEPING, callbacks), 240)
    assert code == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["stopped_early"].startswith("stopped early at step 6: eval/loss did not")
    assert summary["checkpoints/kept"] == {"step_6": "among the 1 newest (trainer.keep_last)"}
    assert kept_steps(tmp_path) == [6] and whole(tmp_path / "step_6") == 6
    assert whole(tmp_path / "last") == 6
    every, zero = calls(tmp_path, "every"), calls(tmp_path, "zero")
    assert sorted(every) == [0, 1] and sorted(zero) == [0]
    hooks = [call[:2] for call in every[0]]
    assert hooks[:5] == [
        ["after_step", 1],
        ["after_step", 2],
        ["after_evaluation", 2],
        ["after_save", 2],
        ["after_save", 2],
    ]
    assert hooks[-1] == ["at_end", 6] and every[0][-1][2] == "completed"
    assert [call[:-2] for call in every[1]] == [call[:-2] for call in every[0]]
    assert {tuple(call[-2:]) for call in every[1]} == {(1, 2)}  # run.rank, run.world_size
    assert [call[:-2] for call in zero[0]] == [call[:-2] for call in every[0]]


def test_a_callback_failing_on_rank_1_stops_every_rank_in_one_line(tmp_path: Path) -> None:
    callbacks = f"trainer.callbacks=[{{_target_: {HOOKS}.Failing, rank: 1}}]"
    code, output = finish(train_under_torchrun(tmp_path, *TORCHRUN_MLP, *KEEPING, callbacks), 240)
    assert code != 0, output
    line = (
        f"CallbackError: trainer.callbacks[0] ({HOOKS}.Failing) failed in after_step at step 3 "
        "on rank 1: ValueError: no room on the dashboard; the run stopped (last good checkpoint: "
        f"{tmp_path / 'last'} (step 2)): fix it and resume with trainer.resume=true"
    )
    errors = [row for row in output.splitlines() if row.startswith("error:")]
    assert f"error: rank 1: {line}" in errors, output
    # rank 0's line (with its traceback file) if it is printed before torchrun stops rank 0
    assert all(row.startswith((f"error: {line}", f"error: rank 1: {line}")) for row in errors)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == line
    assert whole(tmp_path / "last") == 2 and kept_steps(tmp_path) == [2]
