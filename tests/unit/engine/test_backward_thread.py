"""Every stage's backward runs on the thread of the action that asks for it, with autograd's
multithreading off (issue 21, items 5 and 11).

On CUDA, a backward started from a thread that is not one of autograd's runs its CUDA nodes on
the device's autograd thread; the front door's backward is itself called on that thread and
waits for the workers, so the pipeline would hang, and a rank's gradient hooks (its NCCL
all-reduces) would run off its one thread. On CPU every caller runs its own graph, so the
thread alone cannot show the bug here: the probes also read the multithreading flag autograd
carries into every node and hook of a backward, which is what sends CUDA nodes elsewhere.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.executor import StepRun
from giantpipe.engine.gpipe import PipelineFunction
from giantpipe.engine.schedules import VIRTUAL_STAGES, schedule_builders
from giantpipe.engine.schedules.actions import Action

Record = tuple[int, int, bool, Action | None]  # stage, thread, multithreading, running action

_running = threading.local()  # the action this thread runs (see track_actions)


def running_action() -> Action | None:
    return getattr(_running, "action", None)


class _Scale(torch.autograd.Function):
    """y = x * weight; its backward notes where it ran."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, probe: Probe) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.probe = probe
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.probe.note()
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum(0), None


class Probe(nn.Module):
    """A layer with a weight, on the input path: its backward runs in B (input gradient) and,
    under a split backward, again in W (its weight's gradient starts there)."""

    def __init__(self, stage: int, width: int, records: list[Record]) -> None:
        super().__init__()
        self.stage = stage
        self.weight = nn.Parameter(torch.ones(width))
        self.records = records

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(x, self.weight, self)

    def note(self) -> None:
        record = (
            self.stage,
            threading.get_ident(),
            torch.autograd.is_multithreading_enabled(),
            running_action(),
        )
        self.records.append(record)


def probed_model(num_stages: int, records: list[Record], width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for stage in range(num_stages):
        layers += [nn.Linear(width, width), Probe(stage, width, records)]
    return nn.Sequential(*layers)


@pytest.fixture
def actions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, Action]]:
    """Every action run, with its thread; the running action readable by the probes."""
    ran: list[tuple[int, Action]] = []
    real = StepRun._act

    def act(self: StepRun, action: Action) -> None:
        ran.append((threading.get_ident(), action))
        _running.action = action
        try:
            real(self, action)
        finally:
            _running.action = None

    monkeypatch.setattr(StepRun, "_act", act)
    return ran


def check_records(records: list[Record], num_stages: int, chunks: int) -> None:
    """Each probe's backward ran on its own stage's B or W action, on that action's thread,
    with multithreading off."""
    for stage in range(num_stages):
        mine = [r for r in records if r[0] == stage]
        assert len(mine) >= chunks, f"stage {stage}: {len(mine)} backwards for {chunks} B"
        for _, _, multithreading, action in mine:
            assert action is not None, f"stage {stage}: a backward ran outside any action"
            assert action.kind in "BW" and action.stage == stage, (stage, action)
            assert multithreading is False, f"stage {stage}: backward with multithreading on"


def check_threads(records: list[Record], ran: list[tuple[int, Action]]) -> None:
    threads = {(a.kind, a.stage, a.microbatch): t for t, a in ran}
    for stage, thread, _, action in records:
        assert action is not None
        assert thread == threads[(action.kind, action.stage, action.microbatch)], (stage, action)


@pytest.mark.parametrize("schedule", sorted(schedule_builders()))
def test_train_step_runs_each_stage_backward_on_its_action_thread(
    schedule: str, actions: list[tuple[int, Action]]
) -> None:
    records: list[Record] = []
    v = VIRTUAL_STAGES.get(schedule, 1)
    stages, chunks = 2 * v, 4
    pipe = GPipe(
        probed_model(stages, records),
        [2] * stages,
        devices=["cpu", "cpu"],
        chunks=chunks,
        schedule=schedule,
        checkpoint="except_last",
    )
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.train_step(x, y, nn.functional.mse_loss)
    check_records(records, stages, chunks)
    check_threads(records, actions)
    if schedule.startswith("zb"):  # the split backward's W walks from the probe too
        assert any(a is not None and a.kind == "W" for *_, a in records)
    pipe.close()


def test_a_lone_worker_runs_backward_on_the_callers_thread_with_multithreading_off(
    actions: list[tuple[int, Action]],
) -> None:
    # K=1 runs on the calling thread, as a distributed rank runs its actions: the backward,
    # and so every hook it fires, stays on that thread (it must not hop to a device thread).
    records: list[Record] = []
    pipe = GPipe(probed_model(1, records), [2], devices=["cpu"], chunks=2)
    pipe.train_step(torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
    check_records(records, 1, 2)
    assert {thread for _, thread, _, _ in records} == {threading.get_ident()}
    assert torch.autograd.is_multithreading_enabled()  # the caller's flag is given back


@pytest.mark.parametrize("workers", [1, 2])
def test_front_door_backward_runs_on_worker_threads_not_autograds(
    workers: int, actions: list[tuple[int, Action]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # loss.backward() calls PipelineFunction.backward on autograd's thread (on CUDA, the output
    # device's): no stage's backward may run there, for one worker as for several.
    callers: list[int] = []
    real = PipelineFunction.backward

    def backward(ctx: Any, *grads: Any) -> Any:
        callers.append(threading.get_ident())
        return real(ctx, *grads)

    monkeypatch.setattr(PipelineFunction, "backward", staticmethod(backward))
    records: list[Record] = []
    pipe = GPipe(probed_model(workers, records), [2] * workers, devices=["cpu"] * workers, chunks=4)
    x = torch.randn(8, 8, requires_grad=True)
    pipe(x).square().mean().backward()
    assert len(callers) == 1
    check_records(records, workers, 4)
    check_threads(records, actions)
    assert callers[0] not in {thread for _, thread, _, _ in records}
    assert x.grad is not None
    pipe.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_post_accumulate_grad_hooks_run_on_the_action_thread(
    workers: int, actions: list[tuple[int, Action]]
) -> None:
    # A distributed rank starts its gradient buckets' all-reduces from these hooks: under NCCL
    # every collective must come from the one thread that runs the rank's actions.
    model = probed_model(workers, [])
    seen: list[tuple[int, bool, Action | None]] = []

    def hook(param: torch.Tensor) -> None:
        seen.append(
            (threading.get_ident(), torch.autograd.is_multithreading_enabled(), running_action())
        )

    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.weight.register_post_accumulate_grad_hook(hook)
    pipe = GPipe(model, [2] * workers, devices=["cpu"] * workers, chunks=3, schedule="1f1b")
    pipe.train_step(torch.randn(6, 8), torch.randn(6, 8), nn.functional.mse_loss)
    assert len(seen) == 3 * workers
    threads = {(a.kind, a.stage, a.microbatch): t for t, a in actions}
    for thread, multithreading, action in seen:
        assert action is not None and action.kind == "B"
        assert thread == threads[("B", action.stage, action.microbatch)]
        assert multithreading is False
    if workers == 1:
        assert {thread for thread, _, _ in seen} == {threading.get_ident()}
    pipe.close()


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_a_split_backwards_w_runs_the_post_accumulate_grad_hooks(
    schedule: str, actions: list[tuple[int, Action]]
) -> None:
    # W accumulates into p.grad by hand; the replicas' gradient buckets start from these hooks,
    # so without them a zero-bubble step overlaps no all-reduce with its backward.
    v = 2 if schedule == "zb-v" else 1
    model = probed_model(2 * v, [])  # a Linear and a probe per stage
    seen: list[tuple[int, Action | None]] = []
    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.weight.register_post_accumulate_grad_hook(
                lambda p: seen.append((threading.get_ident(), running_action()))
            )
    pipe = GPipe(model, [2] * (2 * v), devices=["cpu"] * 2, chunks=3, schedule=schedule)
    pipe.train_step(torch.randn(6, 8), torch.randn(6, 8), nn.functional.mse_loss)
    linears = sum(isinstance(layer, nn.Linear) for layer in model)
    assert len(seen) == 3 * linears  # once per micro-batch and parameter, as autograd does
    threads = {(a.kind, a.stage, a.microbatch): t for t, a in actions}
    assert any(a is not None and a.kind == "W" for _, a in seen)
    for thread, action in seen:
        assert action is not None and thread == threads[tuple(action)]
    pipe.close()
