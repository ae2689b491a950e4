"""The transport of boundary values: a layout announced once, then one message per value.

Frames and the layout cache need no second process (fast, no marker); the round trips through
:class:`P2PMailbox` (first step, steady state, a smaller last micro-batch, a longer sequence, a
long description) run on two gloo ranks, check every value received equal to the one sent, and
count the messages each took; a peer that dies or goes silent mid-step is named within the
timeout.
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
    FOLLOW_UPS,
    FRAMES,
    POSTED_AT_START,
    P2PMailbox,
    expected_receives,
    sends_to,
)
from giantpipe.engine.distributed.wire import (
    ALIGN,
    HEADER_BYTES,
    Frame,
    KnownLayouts,
    encode,
    header,
    pack,
    prefix_of,
    unpack,
)
from giantpipe.engine.schedules import build_schedule
from tests.distributed.launch import spawn, start_processes
from tests.distributed.workers import registered_schedules, virtual_stages_for


def mixed_value() -> tuple[Any, ...]:
    return (
        torch.randn(3, 5).t(),  # not contiguous
        torch.tensor([[True, False, True]]),
        torch.arange(5, dtype=torch.int32),
        torch.tensor(2.5, dtype=torch.bfloat16),  # 0-dim
        torch.zeros(0, 7),  # empty
        None,
        -3,
        0.25,
        False,
        torch.randn(2, dtype=torch.complex128),
    )


def assert_same(sent: Any, got: Any) -> None:
    if isinstance(sent, torch.Tensor):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
        return
    assert isinstance(got, tuple) and len(got) == len(sent)
    for a, b in zip(sent, got):
        if isinstance(a, torch.Tensor):
            assert_same(a, b)
        else:
            assert a == b and type(a) is type(b)


def test_a_frame_carries_any_value_as_views_of_one_message() -> None:
    value = mixed_value()
    words, tensors = encode(value)
    frame = Frame.of(words)
    assert all(offset % ALIGN == 0 for offset in frame.offsets)
    assert frame.offsets[0] == HEADER_BYTES and frame.nbytes % ALIGN == 0
    message = pack(frame, tensors, seed=9, key=("grad", 2, 5))
    assert message.numel() == frame.nbytes
    assert prefix_of(message) == (0, 9, ("grad", 2, 5), frame.nbytes)
    got = unpack(frame, message)
    assert_same(value, got)
    storage = message.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in got if torch.is_tensor(t))
    lone = torch.randn(4, 6)
    lone_frame = Frame.of(encode(lone)[0])
    assert_same(lone, unpack(lone_frame, pack(lone_frame, [lone], 1, ("act", 1, 0))))
    # lazy views whose memory is not their values: a conjugate, a negation (copied, resolved)
    z = torch.randn(3, dtype=torch.complex64)
    for view in (z.conj(), z.conj().imag):
        assert view.is_conj() or view.is_neg()
        view_frame = Frame.of(encode(view)[0])
        got = unpack(view_frame, pack(view_frame, [view], 1, ("act", 1, 0)))
        assert torch.equal(got, view.resolve_conj().resolve_neg())


def test_an_announcement_fits_any_receive_posted_for_a_known_frame() -> None:
    smallest = Frame.of(encode((None,))[0])  # no tensor: the header alone
    assert smallest.nbytes == HEADER_BYTES
    head, _ = header(encode(mixed_value())[0], seed=4, key=("act", 3, 1))
    n, seed, key, size = prefix_of(head.view(torch.uint8))
    assert (n, seed, key, size) == (len(encode(mixed_value())[0]), 4, ("act", 3, 1), 0)
    assert head.numel() * 8 == HEADER_BYTES <= smallest.nbytes


def test_the_layout_cache_announces_first_steps_and_changes_only() -> None:
    known, key = KnownLayouts(), ("act", 1, 0)
    x = torch.randn(4, 8)
    assert known.changed(key, encode(x)[0])  # first step
    known.sent[key] = Frame.of(encode(x)[0])
    assert not known.changed(key, encode(torch.randn(4, 8))[0])  # steady state
    assert known.changed(key, encode(torch.randn(4, 9))[0])  # sequence length changed
    assert known.changed(key, encode(x.double())[0])  # dtype changed
    assert known.changed(key, encode((x, None))[0])  # structure changed
    assert known.changed(("act", 1, 1), encode(x)[0])  # another key: its own entry
    pair = (x, 3)
    known.sent[key] = Frame.of(encode(pair)[0])
    assert known.changed(key, encode((x, 4))[0])  # a plain item is part of the layout


@pytest.mark.parametrize("name", registered_schedules())
@pytest.mark.parametrize("workers", [2, 4])
def test_every_peer_sends_what_its_receiver_expects(name: str, workers: int) -> None:
    v = virtual_stages_for(name, workers, 4)
    assert v is not None
    plan = build_schedule(name, workers, 4, v)
    for rank in range(workers):
        layout = Layout(workers, rank, workers, plan.placement)
        for peer, keys in expected_receives(plan.actions[rank], layout).items():
            order = sends_to(plan.actions[peer], layout, rank)
            assert sorted(order) == sorted(keys) and len(set(order)) == len(order)


# ---- round trips through the mailbox on two ranks --------------------------------------------

KEYS = {0: [("act", 1, 0), ("act", 1, 1)], 1: [("grad", 0, 0), ("grad", 0, 1)]}  # rank -> sent
FIRST, STEADY, SMALLER, LONGER, LONG, STEADY_AGAIN = range(6)  # the steps of a round trip


def value_of(step: int, kind: str, m: int) -> Any:
    """What crosses under ``(kind, ·, m)`` in ``step`` (both ranks rebuild it to compare).

    Activations are tuples as a decoder's (a strided float tensor still attached to a graph, a
    bool mask, int32 positions, a plain int); gradients a float tensor, None for the mask, an
    int64 tensor. Step SMALLER shrinks the last micro-batch only (a batch that does not divide
    evenly), LONGER grows the sequence of every value, LONG is a tuple whose description does
    not fit the header (the extra words travel too).
    """
    g = torch.Generator().manual_seed(100 * step + 10 * m + (kind == "grad"))
    rows = 9 if step == SMALLER and m == 1 else 16  # sizes past the frame's 64-byte padding
    cols = 20 if step == LONGER else 8
    if step >= LONG:  # and STEADY_AGAIN
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


def mailbox_round_trips(tmp: Path, steps: int = 6) -> dict[Any, Any]:
    """Each rank runs its GPipe actions (K=2, M=2) against a mailbox, without a model, and the
    values of ``value_of`` cross; twice: with every receive of a step posted ahead (gloo), and
    one per peer (NCCL). Returns, per ``ahead``, for each step the (key, tag, bytes) of every
    message this rank sent and the seed this rank held at the end."""
    rank = dist.get_rank()
    plan = build_schedule("gpipe", 2, 2)
    layout = Layout(2, rank, 2, plan.placement)
    real_isend, current = dist.isend, [("", 0, 0)]
    out: dict[Any, Any] = {}
    for ahead in (None, 1):
        known, sent, seeds = KnownLayouts(), [], []

        def counting(
            tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, sent: Any = sent
        ) -> Any:
            sent[-1].append((current[0], tag, tensor.numel() * tensor.element_size()))
            return real_isend(tensor, dst=dst, group=group, tag=tag)

        dist.isend = counting  # type: ignore[assignment]
        try:
            for step in range(steps):
                sent.append([])
                seed = 40 + step if rank == 0 else None
                box = P2PMailbox(
                    layout, dist.group.WORLD, 20.0, seed=seed, known=known, ahead=ahead
                )
                box.start(plan.actions)
                play(box, plan.actions[rank], step, current)
                box.finish()
                seeds.append(box.seed)
        finally:
            dist.isend = real_isend  # type: ignore[assignment]
        out[ahead] = {"sent": sent, "seeds": seeds}
    return out


def play(box: P2PMailbox, actions: Any, step: int, current: list[Any], stop: Any = None) -> None:
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
            current[0] = put
            box.put(put, value_of(step, put[0], m))


def tags_by_key(messages: list[tuple[Any, int, int]]) -> dict[Any, list[int]]:
    by_key: dict[Any, list[int]] = {}
    for key, tag, _ in messages:
        by_key.setdefault(key, []).append(tag)
    return by_key


def frame_sizes(messages: list[tuple[Any, int, int]]) -> dict[Any, int]:
    """Each key's frame bytes: its last message (an announcement's frame is its follow-up)."""
    return {key: size for key, _, size in messages}


@pytest.mark.distributed
def test_values_cross_as_one_message_once_their_layout_is_known(tmp_path: Path) -> None:
    results = spawn("tests.distributed.test_transport:mailbox_round_trips", world=2, tmp=tmp_path)
    announced, frame_only = [FRAMES, FOLLOW_UPS], [FRAMES]
    for rank, by_ahead in enumerate(results):
        # every received value was checked equal on the receiving rank (play); here: messages
        for ahead, r in by_ahead.items():
            assert r["seeds"] == [40, 41, 42, 43, 44, 45], ahead  # rank 1 learned each seed
            tags = [tags_by_key(s) for s in r["sent"]]
            sizes = [frame_sizes(s) for s in r["sent"]]
            keys = KEYS[rank]
            # first step: each value announced (a header on the frames' tag), its frame follows
            assert tags[FIRST] == {k: announced for k in keys}, ahead
            assert all(size == HEADER_BYTES for _, t, size in r["sent"][FIRST] if t == FRAMES)
            # steady state: one message per value, as big as the frame announced in step 1
            assert tags[STEADY] == {k: frame_only for k in keys}, ahead
            assert sizes[STEADY] == sizes[FIRST]
            # the last micro-batch smaller: that key alone announced, its frame smaller
            assert tags[SMALLER] == {keys[0]: frame_only, keys[1]: announced}, ahead
            assert sizes[SMALLER][keys[1]] < sizes[STEADY][keys[1]]
            # a longer sequence: every key announced again (m=1 also back to its old rows)
            assert tags[LONGER] == {k: announced for k in keys}, ahead
            assert all(sizes[LONGER][k] > sizes[STEADY][k] for k in keys)
            # a long description: header, extra words, frame; then one message again
            assert tags[LONG] == {k: [FRAMES, FOLLOW_UPS, FOLLOW_UPS] for k in keys}, ahead
            assert tags[STEADY_AGAIN] == {k: frame_only for k in keys}, ahead


WINDOW_M = 6  # micro-batches in the posting-window round trip: more than POSTED_AT_START


def pending(box: P2PMailbox) -> int:
    """Receives the mailbox has posted and not yet taken, over all its peers."""
    return sum(len(stream.posted) for stream in box._streams.values())


def window_round_trips(tmp: Path) -> dict[str, Any]:
    """GPipe (K=2, M=6), two steps (layouts announced, then steady). Each rank records how many
    receives were pending right after ``start`` and the most pending at once; rank 1 sleeps
    before its first get of the steady step, so its peer's frames land in the two receives
    posted at start and wait for the rest to be posted in its gets. Every value is checked."""
    import time

    rank = dist.get_rank()
    plan = build_schedule("gpipe", 2, WINDOW_M)
    layout = Layout(2, rank, 2, plan.placement)
    known = KnownLayouts()
    at_start, most = [], []
    for step in (FIRST, STEADY):
        seed = 40 + step if rank == 0 else None
        box = P2PMailbox(layout, dist.group.WORLD, 20.0, seed=seed, known=known)
        box.start(plan.actions)
        at_start.append(pending(box))
        peak = [pending(box)]
        real_take = box._take

        def take(
            stream: Any, box: P2PMailbox = box, real: Any = real_take, peak: list[int] = peak
        ) -> None:
            peak[0] = max(peak[0], pending(box))
            real(stream)

        box._take = take  # type: ignore[method-assign]
        if rank == 1 and step == STEADY:
            time.sleep(0.5)
        play(box, plan.actions[rank], step, [None])
        box.finish()
        most.append(peak[0])
    return {"at_start": at_start, "most": most}


@pytest.mark.distributed
def test_receives_beyond_the_window_are_posted_while_waiting(tmp_path: Path) -> None:
    results = spawn("tests.distributed.test_transport:window_round_trips", world=2, tmp=tmp_path)
    for rank, r in enumerate(results):
        # every value was checked equal where it arrived (play); each rank receives from one peer
        assert r["at_start"] == [POSTED_AT_START, POSTED_AT_START], rank
        assert all(POSTED_AT_START <= n <= WINDOW_M for n in r["most"]), (rank, r)
    # rank 0 waits for gradients while rank 1 computes: the whole step's receives get posted
    assert results[0]["most"][STEADY] == WINDOW_M, results[0]


# ---- a peer that dies or goes silent mid-step -------------------------------------------------

SILENT_TIMEOUT = 2.0  # seconds: the mailbox's timeout in the failure tests


def mailbox_failure(tmp: Path, how: str) -> dict[str, Any]:
    """Two GPipe steps (K=2, M=2) through mailboxes; in the second (steady state: every
    receive posted ahead) rank 1 dies (SIGKILL) or goes silent right after its first
    activation arrives. Rank 0 returns the failure it raised and how long after the trigger."""
    import os
    import signal
    import time

    from giantpipe.engine.distributed.faults import RankFailure

    rank = dist.get_rank()
    plan = build_schedule("gpipe", 2, 2)
    layout = Layout(2, rank, 2, plan.placement)
    known, trigger = KnownLayouts(), tmp / "trigger"

    def stop(key: Any) -> None:
        if rank == 1 and step == 1:
            trigger.write_text(str(time.time()))
            if how == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # alive but silent: the peer's timeout must fire

    try:
        for step in range(2):
            seed = 40 + step if rank == 0 else None
            box = P2PMailbox(
                layout, dist.group.WORLD, SILENT_TIMEOUT, seed=seed, known=known, ahead=None
            )
            box.start(plan.actions)
            play(box, plan.actions[rank], step, [None], stop)
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
    procs = start_processes(
        2, "tests.distributed.test_transport:mailbox_failure", tmp_path, how=how
    )
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
