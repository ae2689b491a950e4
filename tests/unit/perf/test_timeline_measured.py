"""The executor's own timeline: every action of a step timed (``pipe.last_timings``), drawn like
the simulator's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.schedules.actions import Action
from giantpipe.engine.stats import ActionTiming
from giantpipe.perf.timeline import measured_timeline, plot_measured


def test_measured_timeline_starts_at_zero_and_maps_stages_to_workers() -> None:
    timings = [
        ActionTiming(Action("F", 2, 0), start=10.5, end=11.0),
        ActionTiming(Action("F", 0, 0), start=10.0, end=10.5),
        ActionTiming(Action("B", 1, 0), start=11.0, end=13.0, waited=0.5, recompute=0.25),
    ]
    got = [
        (t.action, t.worker, t.start, t.end, t.busy, t.recompute)
        for t in measured_timeline(timings, placement=[0, 1, 0, 1])
    ]
    assert got == [
        (Action("F", 0, 0), 0, 0.0, 0.5, 0.5, 0.0),
        (Action("F", 2, 0), 0, 0.5, 1.0, 0.5, 0.0),
        (Action("B", 1, 0), 1, 1.0, 3.0, 1.5, 0.25),
    ]
    assert measured_timeline([], placement=[0]) == []


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_a_step_times_each_action_once_and_adds_up_to_its_busy_time(
    schedule: str, v: int, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)])
    pipe = GPipe(
        model,
        [8 // (2 * v)] * (2 * v),
        devices=["cpu"] * 2,
        chunks=4,
        checkpoint="except_last",
        schedule=schedule,
        virtual_stages=v,
    )
    pipe.train_step(torch.randn(16, 16), torch.randn(16, 16), nn.functional.mse_loss)
    plan = pipe.step_schedule()
    assert Counter(t.action for t in pipe.last_timings) == Counter(
        a for worker in plan.actions for a in worker
    )
    timeline = measured_timeline(pipe.last_timings, plan.placement)
    assert min(t.start for t in timeline) == 0.0
    busy = [sum(t.busy for t in timeline if t.worker == w) for w in range(2)]
    assert pipe.last_stats is not None
    assert busy == pytest.approx(pipe.last_stats.busy_time_s, rel=1e-6, abs=1e-9)
    out = plot_measured(pipe.last_timings, plan, tmp_path / "measured.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
