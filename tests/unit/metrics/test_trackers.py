"""The outside trackers write each per-stage figure under its own stage (issue 32, item 7).

A per-stage list (``train/busy_time_s``: stage 0's seconds first) becomes one scalar per stage,
``train/busy_time_s/stage0`` ... ; written in reverse order, every stage's curve would show
another stage's figures, and nothing else in the suite reads the figures back. Here the
TensorBoard event file is read back with TensorBoard's own reader, and W&B's flattening is
checked on a stand-in module (no W&B run is started).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from giantpipe.metrics.trackers import TensorBoardSink, WandbSink

RECORD = {
    "train/loss": 1.5,
    "train/busy_time_s": [0.125, 0.25, 0.5],  # stages 0, 1, 2: all different
    "train/peak_memory_mib": [10.0, 20.0, 30.0],
    "train/finite": True,  # a flag, not a figure
}


def test_tensorboard_writes_each_stage_under_its_own_name(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tensorboard")
    sink.log(RECORD, step=3)
    sink.log({**RECORD, "train/busy_time_s": [1.0, 2.0, 4.0]}, step=4)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()

    def curve(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert curve("train/busy_time_s/stage0") == [(3, 0.125), (4, 1.0)]
    assert curve("train/busy_time_s/stage1") == [(3, 0.25), (4, 2.0)]
    assert curve("train/busy_time_s/stage2") == [(3, 0.5), (4, 4.0)]
    assert curve("train/peak_memory_mib/stage2") == [(3, 30.0), (4, 30.0)]
    assert curve("train/loss") == [(3, 1.5), (4, 1.5)]
    assert "train/finite" not in events.Tags()["scalars"]


def test_wandb_logs_each_stage_under_its_own_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logged: list[tuple[dict[str, Any], int]] = []
    run = SimpleNamespace(log=lambda values, step: logged.append((values, step)), summary={})
    stand_in = SimpleNamespace(init=lambda **kwargs: run, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    sink = WandbSink("project", "offline", tmp_path, "run", {})
    sink.log(RECORD, step=3)
    values, step = logged[0]
    assert step == 3
    assert values["train/busy_time_s/stage0"] == 0.125
    assert values["train/busy_time_s/stage1"] == 0.25
    assert values["train/busy_time_s/stage2"] == 0.5
    assert values["train/peak_memory_mib/stage0"] == 10.0
    assert values["train/loss"] == 1.5
