"""trainer.trace_steps under torchrun: rank 0 gathers every rank's timings of the step and writes
one trace, a process per rank (its stages as tracks) beside the simulated step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.ranks import finish
from tests.support.train import train_under_torchrun

pytestmark = pytest.mark.distributed

MLP = [
    "recipe=mlp_quickstart",
    "data.train_size=256",
    "data.eval_size=64",
    "trainer.eval_every=0",
    "logger.progress=none",
]


def test_a_traced_step_has_a_process_per_rank_beside_the_simulated_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train_under_torchrun(run, *MLP, "trainer.max_steps=3", "trainer.trace_steps=[3]")
    code, output = finish(proc, timeout=240)
    assert code == 0, output
    events = json.loads((run / "trace-step3.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["measured, rank 0", "measured, rank 1", "simulated"]
    tracks = {processes[e["pid"]]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks["measured, rank 0"] == "stage 0" and tracks["measured, rank 1"] == "stage 1"
    rank1 = {e["name"] for e in events if processes.get(e["pid"]) == "measured, rank 1"}
    assert {"forward", "backward", "receive", "send"} <= rank1
