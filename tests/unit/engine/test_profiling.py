"""torch.profiler sees the stages: a plain ``torch.profiler.profile()`` (it follows the calling
thread only) records each stage's ops (``aten::addmm``) inside a range naming the action
(``giantpipe forward stage 1 mb 0``), for every schedule, the step equal to an unprofiled one;
a profiler following every thread sees them on the stages' own worker threads."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from giantpipe import GPipe


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8), torch.arange(4) % 4


def action_of(event) -> str | None:
    """The name of the giantpipe range an op ran in, if any."""
    while event is not None and not event.name.startswith("giantpipe "):
        event = event.cpu_parent
    return None if event is None else event.name


def addmm_by_action(prof) -> dict[str, int]:
    found: dict[str, int] = {}
    for event in prof.events():
        if event.name == "aten::addmm":
            action = action_of(event) or "outside any action"
            found[action] = found.get(action, 0) + 1
    return found


FORWARDS = {f"giantpipe forward stage {s} mb {m}": 1 + (s == 1) for s in (0, 1) for m in (0, 1)}
RECOMPUTED = {f"giantpipe backward stage {s} mb 0": 1 + (s == 1) for s in (0, 1)}
"""Stage 0 holds one Linear, stage 1 two: one addmm per Linear and micro-batch in its forward,
and again in the backward that re-materializes it (checkpoint="except_last": micro-batch 0)."""


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_plain_profiler_records_every_stages_ops_inside_its_actions(schedule: str) -> None:
    plain = model()
    pipe = GPipe(plain, [2, 2], devices=["cpu", "cpu"], chunks=2, schedule=schedule)
    twin = copy.deepcopy(plain)
    other = GPipe(twin, [2, 2], devices=["cpu", "cpu"], chunks=2, schedule=schedule)
    x, y = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to tell: the profiler sees every stage
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = pipe.train_step(x, y, F.cross_entropy)
    unprofiled = other.train_step(x, y, F.cross_entropy)
    pipe.close()
    other.close()
    assert addmm_by_action(prof) == FORWARDS | RECOMPUTED
    names = {e.name for e in prof.events()}
    assert {f"giantpipe backward stage {s} mb {m}" for s in (0, 1) for m in (0, 1)} <= names
    assert torch.equal(loss, unprofiled)
    for mine, its in zip(plain.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine.grad, its.grad)  # the same step, profiled or not


def test_a_plain_profiler_sees_the_front_doors_forward_and_backward() -> None:
    pipe = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=2)
    x, y = batch()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.cross_entropy(pipe(x), y).backward()
    pipe.close()
    assert addmm_by_action(prof) == FORWARDS | RECOMPUTED
    names = {e.name for e in prof.events()}
    assert {f"giantpipe backward stage {s} mb {m}" for s in (0, 1) for m in (0, 1)} <= names


def test_a_profiler_of_every_thread_sees_each_stage_on_its_own_thread() -> None:
    pipe = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=2)
    x, y = batch()
    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        pipe.train_step(x, y, F.cross_entropy)
    pipe.close()
    assert addmm_by_action(prof) == FORWARDS | RECOMPUTED
    ranges = {s: f"giantpipe forward stage {s}" for s in (0, 1)}
    threads = {
        s: {e.thread for e in prof.events() if (action_of(e) or "").startswith(name)}
        for s, name in ranges.items()
    }
    assert len(threads[0]) == len(threads[1]) == 1 and threads[0] != threads[1]


def test_after_a_profiled_step_the_stages_run_on_their_threads_again() -> None:
    pipe = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=2)
    x, y = batch()
    with profile(activities=[ProfilerActivity.CPU]):
        pipe.train_step(x, y, F.cross_entropy)
    pipe.train_step(x, y, F.cross_entropy)
    assert len(pipe.worker_pool) == 2
    pipe.close()
