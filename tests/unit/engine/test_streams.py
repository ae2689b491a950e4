"""Each worker enters its own device and stream; which workers get a stream of their own, the
joins with the caller's stream, and honest memory figures (issue 21, items 7 and 10).

PyTorch's current device and current stream are thread-local: a worker thread that enters
nothing runs on cuda:0's default stream whatever its stage's device. The streams themselves
need a GPU (benchmarks/gpu_check.py); here CUDA's stream calls are stood in for by recorders.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine import executor, streams
from giantpipe.engine.executor import StepRun
from giantpipe.engine.microbatch import CopyStreams, scatter
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.schedules.actions import Action
from giantpipe.engine.stats import memory_kind
from giantpipe.engine.step_config import LossSpec, StepConfig
from giantpipe.engine.streams import Lane, join_from_caller, join_to_caller, own_streams

CPU = torch.device("cpu")
GPU0, GPU1 = torch.device("cuda:0"), torch.device("cuda:1")

# ---- each worker thread enters its own lane before its first action ---------------------


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, Any]]:
    """("enter" | "exit", thread, lane) and ("act", thread, action), in the order they ran."""
    entries: list[tuple[str, int, Any]] = []
    guard = threading.Lock()

    def note(kind: str, what: Any) -> None:
        with guard:
            entries.append((kind, threading.get_ident(), what))

    def enter_lane(stack: ExitStack, lane: Lane) -> None:
        note("enter", lane)
        stack.callback(note, "exit", lane)

    real_act = StepRun._act

    def act(self: StepRun, action: Action) -> None:
        note("act", action)
        real_act(self, action)

    monkeypatch.setattr(executor, "enter_lane", enter_lane)
    monkeypatch.setattr(StepRun, "_act", act)
    return entries


def check_lanes(log: list[tuple[str, int, Any]], pipe: GPipe) -> None:
    """Every action ran inside a lane its thread entered first: its stage's worker's, on its
    stage's device; each thread left its lane when its phase ended."""
    inside: dict[int, Lane | None] = {}
    for kind, thread, what in log:
        if kind == "enter":
            assert inside.get(thread) is None, "a lane entered twice"
            inside[thread] = what
        elif kind == "exit":
            assert inside.get(thread) == what
            inside[thread] = None
        else:
            lane = inside.get(thread)
            assert lane is not None, f"{what} ran before its thread entered a lane"
            assert lane.worker == pipe.placement[what.stage], (lane, what)
            assert lane.device == pipe.devices[what.stage]
    assert not any(inside.values())
    assert sum(kind == "act" for kind, _, _ in log) > 0


@pytest.mark.parametrize(
    ("schedule", "workers", "stages"),
    [("1f1b", 2, 2), ("interleaved", 2, 4), ("zb-v", 2, 4), ("gpipe", 1, 1)],
)
def test_every_worker_enters_its_own_lane_before_its_first_action(
    schedule: str, workers: int, stages: int, log: list[tuple[str, int, Any]]
) -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(stages)])
    pipe = GPipe(model, [1] * stages, devices=["cpu"] * workers, chunks=4, schedule=schedule)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for _ in range(2):  # a pooled thread enters again in the next step
        pipe.train_step(x, y, nn.functional.mse_loss)
    pipe(x).sum().backward()  # the front door's two phases, each entered
    check_lanes(log, pipe)
    threads = {thread for kind, thread, _ in log if kind == "act"}
    assert len(threads) >= workers
    enters = [what.worker for kind, _, what in log if kind == "enter"]
    assert sorted(set(enters)) == list(range(workers))
    pipe.close()


def test_entering_a_host_lane_changes_nothing() -> None:
    with ExitStack() as stack:
        streams.enter_lane(stack, Lane(0, CPU))
        assert len(stack._exit_callbacks) == 0  # type: ignore[attr-defined]


# ---- which workers get their own stream ------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "own"),
    [
        ([CPU, CPU], [False, False]),  # CPU stand-ins: no streams at all
        ([GPU0], [False]),
        ([GPU0, GPU1], [False, False]),  # one worker per GPU: the caller's current stream
        ([GPU0, GPU0], [True, True]),  # K stages on one GPU: a stream each
        ([GPU0, GPU0, GPU1], [True, True, False]),
        ([GPU0, None, GPU0], [True, False, True]),  # None: a worker with no action here
        ([GPU0, None, GPU1], [False, False, False]),  # a rank's one worker among others
        ([CPU, GPU0, CPU, GPU0], [False, True, False, True]),
    ],
)
def test_own_streams_table(devices: list[torch.device | None], own: list[bool]) -> None:
    assert own_streams(devices) == own


class FakeStream:
    """Stands in for a torch.cuda.Stream: records what it was made to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[str] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other.name)

    def __repr__(self) -> str:
        return self.name


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[torch.device, FakeStream]:
    """The caller's current stream of each device, and workers' own streams, as fakes."""
    current = {GPU0: FakeStream("caller:0"), GPU1: FakeStream("caller:1")}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[device])
    monkeypatch.setattr(
        streams, "worker_stream", lambda device, worker: FakeStream(f"own:{worker}")
    )
    return current


def test_lanes_shared_devices_get_own_streams_joined_with_the_caller_at_both_ends(
    fake_cuda: dict[torch.device, FakeStream],
) -> None:
    lanes = streams.plan_lanes([GPU0, GPU0, GPU1, None, CPU])
    assert [(lane.worker, repr(lane.stream), lane.own) if lane else None for lane in lanes] == [
        (0, "own:0", True),
        (1, "own:1", True),
        (2, "caller:1", False),  # alone on its device: the caller's stream, no join needed
        None,
        (4, "None", False),
    ]
    join_from_caller(lanes)  # the inputs were made on the caller's stream
    assert [lane.stream.waited for lane in lanes[:2] if lane] == [["caller:0"], ["caller:0"]]
    assert fake_cuda[GPU0].waited == [] and fake_cuda[GPU1].waited == []
    join_to_caller(lanes)  # outputs, p.grad and the loss are read on the caller's stream
    assert fake_cuda[GPU0].waited == ["own:0", "own:1"]
    assert fake_cuda[GPU1].waited == []  # its worker ran on it


def test_a_cuda_phase_joins_the_callers_stream_before_its_first_action_and_after_its_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A CUDA run's phase on host devices: its lanes have no streams, so the joins are recorded
    # instead of made; what matters is when, where and with which lanes they are called.
    events: list[tuple[str, int]] = []
    lanes_seen: list[list[Lane | None]] = []

    def joining(name: str) -> Any:
        def join(lanes: list[Lane | None]) -> None:
            events.append((name, threading.get_ident()))
            lanes_seen.append(list(lanes))

        return join

    real = StepRun._act

    def act(self: StepRun, action: Action) -> None:
        events.append(("act", threading.get_ident()))
        real(self, action)

    monkeypatch.setattr(executor, "join_from_caller", joining("from"))
    monkeypatch.setattr(executor, "join_to_caller", joining("to"))
    monkeypatch.setattr(StepRun, "_act", act)
    stages = [nn.Linear(4, 4) for _ in range(4)]
    chunks = 2
    spec = LossSpec(nn.functional.mse_loss, scatter(torch.randn(4, 4), chunks), [0.5] * chunks)
    config = StepConfig(stages, [CPU] * 4, 0, True, 0, loss=spec, placement=[0, 1, 1, 0])
    host = StepRun(config, scatter(torch.randn(4, 4), chunks))
    host.run(build_schedule("zb-v", 2, chunks, 2))
    assert [e for e, _ in events if e != "act"] == []  # a host run joins nothing
    events.clear()
    run = StepRun(config, [])
    run.cuda, run.copies = True, CopyStreams()  # what a CUDA device would set
    for m, x in enumerate(scatter(torch.randn(4, 4), chunks)):
        run.post(("act", 0, m), x)
    run.run(build_schedule("zb-v", 2, chunks, 2))
    kinds = [e for e, _ in events]
    assert kinds[0] == "from" and kinds[-1] == "to" and kinds.count("act") == 3 * 4 * chunks
    caller = threading.get_ident()
    assert events[0][1] == caller and events[-1][1] == caller
    assert [[lane.worker for lane in lanes if lane] for lanes in lanes_seen] == [[0, 1]] * 2


# ---- memory figures are per worker or say they are not ----------------------------------


@pytest.mark.parametrize(
    ("devices", "kind"),
    [
        ([GPU0, GPU1], "cuda_allocator"),
        ([GPU0], "cuda_allocator"),
        ([GPU0, GPU0], "saved_activations"),  # the allocator's peak is the device's, not a stage's
        ([GPU0, GPU1, GPU0], "saved_activations"),
        ([CPU, GPU0], "saved_activations"),
        ([CPU, CPU], "saved_activations"),
    ],
)
def test_memory_kind_table(devices: list[torch.device], kind: str) -> None:
    assert memory_kind(devices) == kind
