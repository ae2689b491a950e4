"""The transport of boundary values: a layout announced once, then one message per value.

Frames and the layout cache need no second process (fast, no marker); the round trips through
:class:`P2PMailbox` (first step, steady state, a shape change, a long description) run on two
gloo ranks and count the messages each value took.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from giantpipe.engine.dist.layout import Layout
from giantpipe.engine.dist.p2p import FOLLOW_UPS, FRAMES, P2PMailbox, expected_receives, sends_to
from giantpipe.engine.dist.wire import (
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
from tests.distributed.launch import spawn
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


def value_of(step: int, kind: str, m: int) -> Any:
    """What crosses in ``step``: the first step, steady, a shape change of m=1, a tuple with a
    long description, steady again."""
    g = torch.Generator().manual_seed(100 * step + 10 * m + (kind == "grad"))
    rows = 5 if step == 2 and m == 1 else 4
    if step >= 3:
        return tuple(torch.randn(1, 1, 1, 1, 1, 1, 1, 2, generator=g) for _ in range(12))
    if kind == "act":
        return torch.randn(rows, 3, generator=g)
    return (torch.randn(rows, 3, generator=g), None, torch.tensor([m, step]))


def mailbox_round_trips(tmp: Path, ahead: int | None, steps: int = 5) -> dict[str, Any]:
    """Each rank runs its GPipe actions (K=2, M=2) against a mailbox, without a model: the
    values of ``value_of`` cross, with ``ahead`` receives posted ahead per peer. Returns per
    step the (key, tag, bytes) of each message this rank sent, and the seed it held at the end
    of each step."""
    rank = dist.get_rank()
    plan = build_schedule("gpipe", 2, 2)
    layout = Layout(2, rank, 2, plan.placement)
    known, sent, seeds = KnownLayouts(), [], []
    real_isend, current = dist.isend, [("", 0, 0)]

    def counting(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
        sent[-1].append((current[0], tag, tensor.numel() * tensor.element_size()))
        return real_isend(tensor, dst=dst, group=group, tag=tag)

    dist.isend = counting  # type: ignore[assignment]
    try:
        for step in range(steps):
            sent.append([])
            seed = 40 + step if rank == 0 else None
            box = P2PMailbox(layout, dist.group.WORLD, 20.0, seed=seed, known=known, ahead=ahead)
            box.start(plan.actions)
            play(box, plan.actions[rank], step, current)
            box.finish()
            seeds.append(box.seed)
    finally:
        dist.isend = real_isend  # type: ignore[assignment]
    return {"sent": sent, "seeds": seeds}


def play(box: P2PMailbox, actions: Any, step: int, current: list[Any]) -> None:
    """One rank's actions of a K=2 pipeline: what each gets is checked, what it puts crosses."""
    for kind, stage, m in actions:
        if kind == "F":
            got, put = ("act", stage, m) if stage > 0 else None, ("act", stage + 1, m)
        else:
            got, put = ("grad", stage, m) if stage < 1 else None, ("grad", stage - 1, m)
        if got is not None:
            assert_same(value_of(step, got[0], m), box.get(got))
        if 0 <= put[1] <= 1 and put[1] != stage:
            current[0] = put
            box.put(put, value_of(step, put[0], m))


def tags_by_key(messages: list[tuple[Any, int, int]]) -> dict[Any, list[int]]:
    by_key: dict[Any, list[int]] = {}
    for key, tag, _ in messages:
        by_key.setdefault(key, []).append(tag)
    return by_key


@pytest.mark.distributed
@pytest.mark.parametrize("ahead", [None, 1])  # gloo: all of the step's receives; NCCL: one
def test_values_cross_as_one_message_once_their_layout_is_known(
    tmp_path: Path, ahead: int | None
) -> None:
    target = "tests.distributed.test_transport:mailbox_round_trips"
    results = spawn(target, world=2, tmp=tmp_path, ahead=ahead)
    announced, frame_only = [FRAMES, FOLLOW_UPS], [FRAMES]
    for rank, r in enumerate(results):
        assert r["seeds"] == [40, 41, 42, 43, 44]  # rank 1 learned each step's seed
        first, steady, changed, long, steady_again = (tags_by_key(s) for s in r["sent"])
        kind, stage = ("act", 1) if rank == 0 else ("grad", 0)
        keys = [(kind, stage, 0), (kind, stage, 1)]
        # first step: each value announced (a header on the frames' tag), its frame follows
        assert first == {k: announced for k in keys}
        assert all(size == HEADER_BYTES for _, tag, size in r["sent"][0] if tag == FRAMES)
        # steady state: one message per value, as big as the frame announced in step 1
        assert steady == {k: frame_only for k in keys}
        frames = {key: size for key, tag, size in r["sent"][0] if tag == FOLLOW_UPS}
        assert {key: size for key, _, size in r["sent"][1]} == frames
        # a shape change announces that key only
        assert changed == {keys[0]: frame_only, keys[1]: announced}
        # a long description: header, extra words, frame; then one message again
        assert long == {k: [FRAMES, FOLLOW_UPS, FOLLOW_UPS] for k in keys}
        assert steady_again == {k: frame_only for k in keys}
