"""The host's wait for the device at the end of a distributed step (issue 21).

``torch.cuda.synchronize`` would block forever behind an NCCL operation whose peer died; the
pipe instead polls an event recorded on the stream, under its timeout, and names the rank and
what it waited for. Fake events stand for CUDA's: no GPU, no timing beyond a tiny timeout.
"""

from __future__ import annotations

import pytest

from giantpipe.engine.dist.faults import FailureBoard, RankFailure, wait_device


class NeverDone:
    """An event behind a hung NCCL operation: the stream never reaches it."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return False

    def synchronize(self) -> None:  # what a blocking wait would call: it never returns
        raise AssertionError("wait_device must poll, not block on the event")


class DoneAfter(NeverDone):
    """An event the stream reaches after ``n`` queries."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def query(self) -> bool:
        super().query()
        return self.queries > self.n


class Store:
    """The part of a c10d store the failure board uses, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, n: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def test_a_device_that_never_gets_there_fails_the_rank_after_the_timeout() -> None:
    board = FailureBoard(Store(), "rank 1 (stage 1)")
    event = NeverDone()
    with pytest.raises(RankFailure) as caught:
        wait_device(event, 0.05, "the step's kernels on cuda:1", board, poll=0.005)
    message = str(caught.value)
    assert message.startswith("rank 1 (stage 1) timed out after")
    assert "the step's kernels on cuda:1" in message
    assert board.read() == message  # on the board: the other ranks are told this rank's cause
    assert event.queries >= 2


def test_a_device_that_gets_there_returns_without_a_failure() -> None:
    board = FailureBoard(Store(), "rank 0 (stage 0)")
    event = DoneAfter(3)
    wait_device(event, 30.0, "the step's kernels on cuda:0", board)
    assert event.queries == 4
    assert board.read() is None
