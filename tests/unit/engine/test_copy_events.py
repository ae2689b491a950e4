"""A value handed between workers carries the event its producer recorded right after computing
it, and the consumer waits for that event only (issue 21, item 6).

Waiting on the producer's whole stream would also wait for the micro-batches it computed after
this one, and serialise the fill. The CUDA side (events, stream waits, copies, record_stream)
needs a GPU and is proven by benchmarks/gpu_check.py; here: a host run records nothing and
moves nothing, and the executor hands every consumer exactly its producer's record, made in the
producer's thread before the value was handed on.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe.engine.executor import StepRun
from giantpipe.engine.mailbox import Mailbox
from giantpipe.engine.microbatch import CopyStreams, cuda_devices, scatter
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.schedules.actions import Action
from giantpipe.engine.step_config import LossSpec, StepConfig


def no_cuda(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a host value reached CUDA")


def test_host_values_record_nothing_and_arrive_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    copies = CopyStreams()
    batch = (torch.randn(2, 3), torch.tensor([1, 0]), None, 7)
    assert cuda_devices(batch) == set() and cuda_devices(batch[0]) == set()
    assert copies.ready(batch) == {}
    arrived = copies.arrive(batch, torch.device("cpu"), {})
    assert all(a is b for a, b in zip(arrived, batch, strict=True))  # the very tensors
    lone = batch[0]
    assert copies.arrive(lone, torch.device("cpu"), None) is lone


class Token:
    """What the fake records for a value: the value itself and the thread it was recorded on."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.thread = threading.get_ident()


_running = threading.local()  # the action this thread runs


class FakeCopies:
    """Stands in for CopyStreams: tokens instead of events, host values unchanged."""

    def __init__(self) -> None:
        self.arrived: list[tuple[Action, Any, Any]] = []  # (taker, value taken, its record)
        self.guard = threading.Lock()

    def ready(self, batch: Any) -> Any:
        return Token(batch)

    def arrive(self, batch: Any, device: torch.device, ready: Any) -> Any:
        with self.guard:
            self.arrived.append((_running.action, batch, ready))
        return batch


def test_each_consumer_waits_for_its_producers_record_of_that_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: dict[tuple[str, int, int], int] = {}  # action -> the thread that ran it
    real = StepRun._act

    def act(self: StepRun, action: Action) -> None:
        threads[(action.kind, action.stage, action.microbatch)] = threading.get_ident()
        _running.action = action
        real(self, action)

    monkeypatch.setattr(StepRun, "_act", act)
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)]
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    chunks = 4
    spec = LossSpec(nn.functional.mse_loss, scatter(y, chunks), [0.25] * chunks)
    config = StepConfig(stages, [torch.device("cpu")] * 3, 0, True, 0, loss=spec)
    run = StepRun(config, [])
    fake = FakeCopies()
    run.copies = fake  # type: ignore[assignment]
    for m, part in enumerate(scatter(x, chunks)):
        run.post(("act", 0, m), part)  # the caller produces the inputs
    run.run(build_schedule("1f1b", 3, chunks))
    # Every stage's inputs, and the gradients of stages 0 and 1, each taken once.
    takers = sorted((a.kind, a.stage, a.microbatch) for a, _, _ in fake.arrived)
    f = [("F", s, m) for s in range(3) for m in range(chunks)]
    b = [("B", s, m) for s in range(2) for m in range(chunks)]
    assert takers == sorted(f + b)
    caller = threading.get_ident()
    for taker, value, token in fake.arrived:
        assert isinstance(token, Token), f"{taker} took a value without its producer's record"
        assert token.value is value  # recorded for this very value ...
        # ... in the thread of the action that produced it, before handing it on
        kind, stage, m = taker.kind, taker.stage, taker.microbatch
        if kind == "F":
            producer = caller if stage == 0 else threads[("F", stage - 1, m)]
        else:
            producer = threads[("B", stage + 1, m)]
        assert token.thread == producer, taker
    assert run.ready == {}  # every record was taken by its consumer


def test_a_value_sent_to_another_process_records_nothing() -> None:
    """A distributed rank's mailbox sends some keys elsewhere: nobody here takes their events
    (the transport orders the device work), so none is recorded or kept for the step."""

    class Elsewhere(Mailbox):
        def consumed_here(self, key: tuple[str, int, int]) -> bool:
            return key[1] != 1  # stage 1 lives on another rank

    stages = [nn.Linear(2, 2), nn.Linear(2, 2)]
    config = StepConfig(stages, [torch.device("cpu")] * 2, 0, True, 0)
    run = StepRun(config, [], mailbox=Elsewhere(5.0))
    fake = FakeCopies()
    run.copies = fake  # type: ignore[assignment]
    run.post(("act", 1, 0), torch.ones(2))
    run.post(("grad", 0, 0), torch.ones(2))
    assert list(run.ready) == [("grad", 0, 0)]
