"""torch.profiler sees the stages: with the profiler following every thread, each stage's ops
(``aten::addmm``) sit inside a range naming the action (``giantpipe forward stage 1 mb 0``), on
the stage's worker thread; a profiler that follows only the caller's thread is told so."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from giantpipe import GPipe


def two_stage_pipe() -> GPipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8), torch.arange(4) % 4


def action_of(event) -> str | None:
    """The name of the giantpipe range an op ran in, if any."""
    while event is not None and not event.name.startswith("giantpipe "):
        event = event.cpu_parent
    return None if event is None else event.name


def test_a_profiled_step_shows_each_stages_ops_inside_its_actions() -> None:
    pipe = two_stage_pipe()
    x, y = batch()
    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        pipe.train_step(x, y, F.cross_entropy)
    pipe.close()
    addmm = [(action_of(e), e.thread) for e in prof.events() if e.name == "aten::addmm"]
    forwards = {a: t for a, t in addmm if a is not None and a.startswith("giantpipe forward")}
    assert set(forwards) == {f"giantpipe forward stage {s} mb {m}" for s in (0, 1) for m in (0, 1)}
    threads = {s: {t for a, t in forwards.items() if f"stage {s} " in a} for s in (0, 1)}
    assert len(threads[0]) == len(threads[1]) == 1 and threads[0] != threads[1]
    names = {e.name for e in prof.events()}
    assert {f"giantpipe backward stage {s} mb {m}" for s in (0, 1) for m in (0, 1)} <= names


def test_a_profiler_of_the_calling_thread_only_is_told_how_to_see_the_stages() -> None:
    pipe = two_stage_pipe()
    x, y = batch()
    with pytest.warns(UserWarning, match="profile_all_threads=True"):
        with profile(activities=[ProfilerActivity.CPU]):
            pipe.train_step(x, y, F.cross_entropy)
    pipe.close()
