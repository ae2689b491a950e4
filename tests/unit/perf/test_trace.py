"""A step as a Chrome / Perfetto trace (giantpipe.perf.timeline.write_trace): one process for the
measured step (one per rank) and one for the simulated step, one track per stage, each action a
slice holding its recompute, wait and work in that order, receive and send marks joined by
arrows. The JSON is parsed back: tracks, event names, nesting."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from giantpipe import GPipe
from giantpipe.engine.schedules.actions import Action
from giantpipe.engine.stats import ActionTiming
from giantpipe.perf.simulate import StageCost, simulate
from giantpipe.perf.timeline import write_trace


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def tracks(events: list[dict]) -> dict[str, set[str]]:
    """Process name -> its tracks' names."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    out: dict[str, set[str]] = defaultdict(set)
    for e in events:
        if e["name"] == "thread_name":
            out[processes[e["pid"]]].add(e["args"]["name"])
    return dict(out)


def test_an_action_holds_its_recompute_wait_and_work_in_order(tmp_path: Path) -> None:
    timings = [
        ActionTiming(Action("F", 0, 0), start=1.0, end=2.0),
        ActionTiming(Action("B", 1, 0), start=5.0, end=9.0, waited=1.0, recompute=0.5),
    ]
    events = load(write_trace(tmp_path / "t.json", [timings]))
    slices = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    assert slices == [
        (0, "F0", 0.0, 1e6),
        (0, "forward", 0.0, 1e6),
        (1, "B0", 4e6, 4e6),
        (1, "recompute", 4e6, 0.5e6),
        (1, "wait", 4.5e6, 1e6),
        (1, "backward", 5.5e6, 2.5e6),
    ]
    marks = [(e["tid"], e["name"], e["ts"]) for e in events if e["ph"] == "i"]
    # the last stage's B takes the loss's gradient (no receive) and sends its input's to stage 0
    assert marks == [(0, "send", 1e6), (1, "send", 8e6)]


def test_a_pipelined_step_and_its_simulation_as_one_trace(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    pipe = GPipe(model, [2, 1, 1], devices=["cpu"] * 3, chunks=3, checkpoint="always")
    pipe.train_step(torch.randn(6, 8), torch.arange(6) % 4, F.cross_entropy)
    pipe.close()
    sim = simulate(pipe.step_schedule(), [StageCost(1e-3, 2e-3)] * 3, recompute="always")
    events = load(write_trace(tmp_path / "trace-step1.json", [pipe.last_timings], sim))

    stages = {f"stage {s}" for s in range(3)}
    assert tracks(events) == {"measured": stages, "simulated": stages}
    measured = [e for e in events if e["pid"] == 0]
    names = {e["name"] for e in measured}
    assert {"forward", "backward", "recompute", "wait", "send", "receive"} <= names
    actions = [e for e in measured if e.get("cat") == "action"]
    assert len(actions) == 3 * 3 * 2  # F and B of 3 micro-batches on 3 stages
    for stage in range(3):  # one track: actions one after another, their parts inside them
        own = sorted((e for e in actions if e["tid"] == stage), key=lambda e: e["ts"])
        for a, b in zip(own, own[1:]):
            assert a["ts"] + a["dur"] <= b["ts"]
        for e in measured:
            if e["ph"] != "X" or e.get("cat") == "action" or e["tid"] != stage:
                continue
            (parent,) = [a for a in own if a["ts"] <= e["ts"] and e["ts"] < a["ts"] + a["dur"]]
            assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + 1e-6, (e, parent)
    starts = {e["id"] for e in measured if e["ph"] == "s"}
    finishes = {e["id"] for e in measured if e["ph"] == "f"}
    assert starts == finishes and len(starts) == 2 * 3 * 2  # 2 boundaries, 3 mbs, F and B
    simulated = {e["name"] for e in events if e["pid"] == 1}
    assert {"forward", "backward", "recompute", "send", "receive"} <= simulated
