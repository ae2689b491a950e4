"""The transport on two gloo ranks: values described on the host in the first step of a layout
of the step's inputs, then their bytes alone, into receives issued in the agreed order, more of
them while the rank waits anyway; a peer that dies or goes silent mid-step is named within the
timeout. (The same on threads, with every message counted: tests/unit/engine/distributed/
test_p2p.py; NCCL's order: test_nccl_order.py.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from giantpipe.engine.distributed.layout import Layout
from giantpipe.engine.distributed.p2p import (
    AHEAD,
    DESCRIPTIONS,
    PAYLOADS,
    STARTS,
    P2PMailbox,
)
from giantpipe.engine.distributed.wire import Layouts
from giantpipe.engine.schedules import build_schedule
from tests.support.ranks import spawn, start_ranks
from tests.support.values import assert_same

# The steps of a round trip, and the layout of their inputs (what stage 0's rank names).
FIRST, STEADY, SMALLER, LONGER, LONG, BACK = range(6)
INPUTS = ["usual", "usual", "smaller", "longer", "long", "usual"]
LEARNING = {FIRST, SMALLER, LONGER, LONG}


def value_of(step: int, kind: str, m: int) -> Any:
    """What crosses under ``(kind, ., m)`` in ``step`` (both ranks rebuild it to compare).

    Activations are tuples as a decoder's (a strided float tensor still attached to a graph, a
    bool mask, int32 positions, a plain int); gradients a float tensor, None for the mask, an
    int64 tensor. SMALLER shrinks the last micro-batch only (a batch that does not divide
    evenly), LONGER grows the sequence of every value, LONG is a tuple whose description does
    not fit one host message.
    """
    g = torch.Generator().manual_seed(100 * step + 10 * m + (kind == "grad"))
    rows = 9 if step == SMALLER and m == 1 else 16
    cols = 20 if step == LONGER else 8
    if step == LONG:
        return tuple(torch.randn(1, 1, 1, 1, 1, 1, 1, 2, generator=g) for _ in range(12))
    if kind == "act":
        leaf = torch.randn(cols, rows, generator=g, requires_grad=True)
        return (
            (leaf * 2).t(),  # not contiguous, requires grad (a non-leaf)
            torch.rand(rows, cols, generator=g) > 0.5,
            torch.arange(cols, dtype=torch.int32) + m,
            rows,
        )
    return (torch.randn(rows, cols, generator=g), None, torch.tensor([m, step]))


def play(box: P2PMailbox, actions: Any, step: int, stop: Any = None) -> None:
    """One rank's actions of a K=2 pipeline: what each gets is checked, what it puts crosses.
    ``stop(key)`` is called after each value got (the failure tests' trigger)."""
    for kind, stage, m in actions:
        if kind == "F":
            got, put = ("act", stage, m) if stage > 0 else None, ("act", stage + 1, m)
        else:
            got, put = ("grad", stage, m) if stage < 1 else None, ("grad", stage - 1, m)
        if got is not None:
            received = box.get(got)
            assert_same(value_of(step, got[0], m), received)
            # Values arrive detached, as the local mailbox hands them on (the executor
            # detaches what it puts); the receiving stage makes its own leaves.
            tensors = received if isinstance(received, tuple) else (received,)
            assert not any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor))
            if stop is not None:
                stop(got)
        if 0 <= put[1] <= 1 and put[1] != stage:
            box.put(put, value_of(step, put[0], m))


def start(box: P2PMailbox, actions: Any, step: int) -> int:
    """Starts ``step`` as a pipe does: stage 0's rank names its seed and inputs' layout."""
    given = (40 + step, INPUTS[step]) if box.layout.needs_inputs else ()
    return box.start(actions, *given)


def mailbox_round_trips(tmp: Path) -> dict[str, Any]:
    """Each rank runs its GPipe actions (K=2, M=2) against a mailbox per step, without a model,
    and the values of ``value_of`` cross. Returns, for each step, the tags of the messages
    this rank sent, and the seed it started the step with."""
    rank = dist.get_rank()
    plan = build_schedule("gpipe", 2, 2)
    layout, layouts = Layout(2, rank, 2, plan.placement), Layouts()
    real_isend, sent, seeds = dist.isend, [], []

    def counting(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
        sent[-1].append(tag)
        return real_isend(tensor, dst=dst, group=group, tag=tag)

    dist.isend = counting  # type: ignore[assignment]
    try:
        for step in range(len(INPUTS)):
            sent.append([])
            box = P2PMailbox(layout, dist.group.WORLD, dist.group.WORLD, 20.0, layouts=layouts)
            seeds.append(start(box, plan.actions, step))
            play(box, plan.actions[rank], step)
            box.finish()
    finally:
        dist.isend = real_isend  # type: ignore[assignment]
    return {"sent": sent, "seeds": seeds}


@pytest.mark.distributed
def test_values_cross_as_their_bytes_once_the_inputs_layout_is_known(tmp_path: Path) -> None:
    results = spawn("tests.distributed.test_transport:mailbox_round_trips", world=2, tmp=tmp_path)
    for rank, r in enumerate(results):
        # every received value was checked equal on the receiving rank (play); here: messages
        assert r["seeds"] == [40 + step for step in range(len(INPUTS))], rank
        for step, tags in enumerate(r["sent"]):
            described = (4 if step == LONG else 2) if step in LEARNING else 0  # two values
            assert tags.count(STARTS) == (1 if rank == 0 else 0), (rank, step)
            assert tags.count(DESCRIPTIONS) == described, (rank, step, tags)
            assert tags.count(PAYLOADS) == 2, (rank, step, tags)
            assert len(tags) == tags.count(STARTS) + described + 2, (rank, step, tags)


WINDOW_M = 6  # micro-batches in the posting-window round trip: more than AHEAD


def window_round_trips(tmp: Path) -> dict[str, Any]:
    """GPipe (K=2, M=6), two steps (layouts learned, then bytes alone). Each rank records how
    many receives were issued right after ``start`` and the most issued not yet taken; rank 1
    sleeps before its first get of the steady step, so its peer's bytes land in the two
    receives issued at start and wait for the rest to be issued in its gets. Every value is
    checked."""
    import time

    rank = dist.get_rank()
    plan = build_schedule("gpipe", 2, WINDOW_M)
    layout, layouts = Layout(2, rank, 2, plan.placement), Layouts()
    at_start, most = [], []
    for step in (FIRST, STEADY):
        box = P2PMailbox(layout, dist.group.WORLD, dist.group.WORLD, 20.0, layouts=layouts)
        start(box, plan.actions, step)
        at_start.append(len(box._posted))
        peak = [len(box._posted)]
        real_post = box._post

        def post(op: Any, box: P2PMailbox = box, real: Any = real_post, peak: Any = peak) -> None:
            real(op)
            peak[0] = max(peak[0], len(box._posted))

        box._post = post  # type: ignore[method-assign]
        if rank == 1 and step == STEADY:
            time.sleep(0.5)
        play(box, plan.actions[rank], step)
        box.finish()
        most.append(peak[0])
    return {"at_start": at_start, "most": most}


@pytest.mark.distributed
def test_receives_beyond_the_window_are_issued_while_waiting(tmp_path: Path) -> None:
    results = spawn("tests.distributed.test_transport:window_round_trips", world=2, tmp=tmp_path)
    first, last = results
    # while layouts are learned, each receive waits for its description: none issued ahead
    assert first["at_start"] == [0, 0] and last["at_start"] == [0, AHEAD]
    assert all(n <= WINDOW_M for r in results for n in r["most"]), results
    # rank 0 waits for gradients while rank 1 computes: every receive of the step is issued,
    # the rest while it waits for the first (taken: not counted)
    assert first["most"][STEADY] == WINDOW_M - 1, first


# ---- a peer that dies or goes silent mid-step -------------------------------------------------

SILENT_TIMEOUT = 2.0  # seconds: the mailbox's timeout in the failure tests


def mailbox_failure(tmp: Path, how: str) -> dict[str, Any]:
    """Two GPipe steps (K=2, M=2) through mailboxes; in the second (bytes alone, receives
    issued ahead) rank 1 dies (SIGKILL) or goes silent right after its first activation
    arrives. Rank 0 returns the failure it raised and how long after the trigger."""
    import os
    import signal
    import time

    from giantpipe.engine.distributed.faults import RankFailure

    rank = dist.get_rank()
    plan = build_schedule("gpipe", 2, 2)
    layout, layouts = Layout(2, rank, 2, plan.placement), Layouts()
    trigger = tmp / "trigger"

    def stop(key: Any) -> None:
        if rank == 1 and step == STEADY:
            trigger.write_text(str(time.time()))
            if how == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # alive but silent: the peer's timeout must fire

    try:
        for step in (FIRST, STEADY):
            group = dist.group.WORLD
            box = P2PMailbox(layout, group, group, SILENT_TIMEOUT, layouts=layouts)
            start(box, plan.actions, step)
            play(box, plan.actions[rank], step, stop)
            box.finish()
    except RankFailure as exc:
        stopped = time.time()
        box.drop()
        return {"failure": str(exc), "after_s": stopped - float(trigger.read_text())}
    return {"failure": None}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("die", r"rank 1 \(stage 1\) is gone \(connection closed\); rank 0 \(stage 0\) waited "
         r"for the gradient of micro-batch 1"),
        ("silent", r"rank 0 \(stage 0\) timed out after 2s waiting for the gradient of "
         r"micro-batch 1 from rank 1 \(stage 1\)"),
    ],
)  # fmt: skip
def test_a_peer_lost_mid_step_is_named_within_the_timeout(
    tmp_path: Path, how: str, expected: str
) -> None:
    procs = start_ranks("tests.distributed.test_transport:mailbox_failure", 2, tmp_path, how=how)
    try:
        procs[0].join(60)
        assert not procs[0].is_alive(), "rank 0 did not stop"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    got = torch.load(tmp_path / "result-0.pt", weights_only=False)
    assert got["ok"], got.get("error")
    failure = got["result"]["failure"]
    assert failure is not None and re.search(expected, failure), failure
    assert got["result"]["after_s"] < SILENT_TIMEOUT + 3, failure
