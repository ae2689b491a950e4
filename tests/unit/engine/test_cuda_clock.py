"""The CUDA clock never blocks the host without a deadline (fake events: no GPU here).

A phase's clock used to synchronize every device at its start and block on each event as it
read it: behind an NCCL operation whose peer died, either would wait for ever. Now the start
records an event and nothing else, and reading waits by polling under the step's timeout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from giantpipe.engine.failures import PipelineTimeout
from giantpipe.engine.stats import CudaClock, settle_events


class FakeEvent:
    """A CUDA event whose stream reaches it after ``ready_after`` queries (never: -1)."""

    def __init__(self, enable_timing: bool = False, ready_after: int = 0) -> None:
        self.queries, self.ready_after = 0, ready_after
        self.recorded_on: Any = None

    def record(self, stream: Any) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        self.queries += 1
        return self.ready_after >= 0 and self.queries > self.ready_after

    def synchronize(self) -> None:
        raise AssertionError("blocked on an event without a deadline")

    def elapsed_time(self, other: FakeEvent) -> float:
        return 5.0


def test_settling_polls_until_every_event_completes() -> None:
    events = [FakeEvent(ready_after=3), FakeEvent(ready_after=0)]
    settle_events(events, timeout=5.0, what="stage kernels")
    assert [e.queries for e in events] == [4, 1]


def test_an_event_the_stream_never_reaches_times_out_naming_what() -> None:
    with pytest.raises(PipelineTimeout, match="stage kernels did not finish .* within 0.05s"):
        settle_events([FakeEvent(ready_after=-1)], timeout=0.05, what="stage kernels")


def test_a_phase_clock_starts_and_reads_without_a_blocking_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_sync(*_: Any) -> None:
        raise AssertionError("torch.cuda.synchronize at the start of a phase")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    gpu = torch.device("cuda", 0)
    clock = CudaClock([gpu, torch.device("cpu")])
    start, end = clock.mark(gpu), clock.mark(gpu)
    clock.settle([start, end], timeout=1.0)
    assert clock.seconds(end) - clock.seconds(start) == 0.0  # both 5 ms after the base
    assert end[1].recorded_on == "stream of cuda:0"
