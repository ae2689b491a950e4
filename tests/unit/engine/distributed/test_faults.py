"""The host's wait for the device at the end of a distributed step (issue 21), and the check
of the step's requests after it (issue 32, item 6).

``torch.cuda.synchronize`` would block forever behind an NCCL operation whose peer died; the
pipe instead polls an event recorded on the stream, under its timeout, and names the rank and
what it waited for. Fake events stand for CUDA's: no GPU, no timing beyond a tiny timeout.

With ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` NCCL's watchdog may abort a hung operation before
that wait ends: the stream goes on, and a receive's buffer holds whatever arrived. After the
device wait every payload request of the step is asked whether it succeeded (``wait_work``, a
host wait under the timeout: an error raises, an aborted request answers False), and the step
raises naming the peer rather than return a loss made of a partial buffer.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from giantpipe.engine.distributed.faults import FailureBoard, RankFailure, wait_device, wait_work
from giantpipe.engine.distributed.layout import Layout
from giantpipe.engine.distributed.p2p import PAYLOADS, P2PMailbox
from giantpipe.engine.schedules import build_schedule
from tests.support.nccl_rules import FakeNetwork


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


class Answers:
    """A request whose host wait answers ``result`` (or raises it), recording the timeout."""

    def __init__(self, result: Any) -> None:
        self.result, self.timeouts = result, []

    def wait(self, timeout: datetime.timedelta | None = None) -> Any:
        self.timeouts.append(timeout)
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def test_wait_work_waits_on_the_host_under_the_timeout_and_names_what_failed() -> None:
    done = Answers(True)
    wait_work(done, 7.0, "the all-reduce of bucket 0", None)
    assert done.timeouts == [datetime.timedelta(seconds=7)]  # a timeout: torch blocks the host
    with pytest.raises(RankFailure, match="receiving x from rank 0 .stage 0. was aborted"):
        wait_work(Answers(False), 7.0, "receiving x from rank 0 (stage 0)", None)
    error = RuntimeError("NCCL communicator was aborted on rank 1")
    with pytest.raises(RankFailure, match="sending y to rank 2 .stage 1. failed: NCCL comm"):
        wait_work(Answers(error), 7.0, "sending y to rank 2 (stage 1)", None)


class AbortedAfterStreamWait:
    """A receive NCCL's watchdog aborted after the consumer's stream wait returned (a wait
    without a timeout): asked later with a timeout, it answers False, as torch's Work does."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            return bool(self.work.wait())
        return False

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def test_a_payload_aborted_after_its_stream_wait_fails_the_step_naming_the_peer() -> None:
    """K=2, GPipe, M=2 through the transport on threads (tests/support/nccl_rules.py),
    rank 1's transfers treated as device operations: one activation receive is aborted after
    its stream wait; rank 1 raises naming rank 0 (at its next operation, once the request is
    complete, or at the check after the step; rank 0, left waiting, times out here, where a
    real pipe's teardown wakes it)."""
    plan = build_schedule("gpipe", 2, 2)
    net, group = FakeNetwork(2), object()
    real_irecv = net.irecv

    def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Any:
        work = real_irecv(tensor, src, group, tag)
        if net.rank != 1 or tag != PAYLOADS:
            return work
        payloads.append(work)
        return AbortedAfterStreamWait(work) if len(payloads) == 1 else work

    payloads: list[Any] = []  # rank 1's payload receives: the first is aborted
    outcome: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        net.as_rank(rank)
        layout = Layout(2, rank, 2, plan.placement)
        board = FailureBoard(Store(), layout.label()) if rank == 1 else None
        timeout = 5.0 if rank == 1 else 0.5  # rank 0 is left waiting: not for long
        box = P2PMailbox(layout, group, group, timeout, board)
        if rank == 1:
            box._on_device = lambda: True  # type: ignore[method-assign] # NCCL's stream waits
        try:
            box.start(plan.actions, *((5, "inputs") if rank == 0 else ()))
            for kind, stage, m in plan.actions[rank]:
                if kind == "F" and stage == 0:
                    box.put(("act", 1, m), torch.full((2, 3), float(m)))
                elif kind == "F":
                    outcome.setdefault("got", []).append(box.get(("act", 1, m)))
                elif stage == 1:
                    box.put(("grad", 0, m), torch.ones(2, 3))
                else:
                    box.get(("grad", 0, m))
            box.finish()
            box.check()  # what the pipe does after the step's device wait
            outcome[rank] = "ok"
        except RankFailure as exc:
            outcome[rank] = str(exc)

    net.irecv = irecv  # type: ignore[method-assign]
    net.run(rank_main)
    assert "got" in outcome  # the values arrived; one request was aborted after its wait
    assert outcome[1] == (
        "rank 1 (stage 1): receiving the activation of micro-batch 0 from rank 0 (stage 0) "
        "was aborted (communicator torn down)"
    )
