"""trainer.trace_steps: the runner writes those optimizer steps as Chrome / Perfetto traces in
the run directory, the measured step beside the simulated one (trainer.predict)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from giantpipe.config import ConfigError, TrainerConfig
from giantpipe.runner import train
from giantpipe.runner.rundir import move_record_aside
from tests.support.runs import tiny


def test_the_steps_asked_for_are_written_as_traces(tmp_path: Path) -> None:
    summary = train(tiny(max_steps=3, eval_every=0, trace_steps=[1, 3]), tmp_path, "name: t\n")
    assert summary["status"] == "completed"
    assert sorted(p.name for p in tmp_path.glob("trace-step*.json")) == [
        "trace-step1.json",
        "trace-step3.json",
    ]
    events = json.loads((tmp_path / "trace-step3.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["measured", "simulated"]
    for pid in processes:
        names = {
            e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == pid
        }
        assert names == {"stage 0", "stage 1"}
        kinds = {e["name"] for e in events if e["pid"] == pid}
        assert {"forward", "backward", "send", "receive"} <= kinds


def test_trace_steps_must_be_a_list_of_steps() -> None:
    with pytest.raises(ConfigError, match="trainer.trace_steps: must be a list"):
        TrainerConfig(trace_steps=[0])


def test_trainer_overwrite_moves_the_traces_aside_with_the_record(tmp_path: Path) -> None:
    (tmp_path / "trace-step3.json").write_text("{}")
    aside = move_record_aside(tmp_path)
    assert (aside / "trace-step3.json").exists() and not (tmp_path / "trace-step3.json").exists()
