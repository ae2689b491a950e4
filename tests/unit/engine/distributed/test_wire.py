"""Boundary values as bytes (engine/distributed/wire.py): descriptions, packed messages, and the
layouts both ends of a boundary remember per layout of the step's inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from giantpipe.engine.distributed.wire import (
    ALIGN,
    DESCRIPTION_WORDS,
    Frame,
    Layouts,
    decode,
    description,
    encode,
    pack,
    render,
    signature,
    unpack,
    words_left,
    words_of,
)
from tests.support.values import assert_same


def mixed_value() -> tuple[Any, ...]:
    return (
        torch.randn(3, 5).t(),  # not contiguous
        torch.tensor([[True, False, True]]),
        torch.arange(5, dtype=torch.int32),
        torch.tensor(2.5, dtype=torch.bfloat16),  # 0-dim
        torch.zeros(0, 7),  # empty: no bytes travel
        None,
        -3,
        0.25,
        False,
        torch.randn(2, dtype=torch.complex128),
    )


def test_a_message_carries_any_value_as_views_of_one_buffer() -> None:
    value = mixed_value()
    words, tensors = encode(value)
    frame = Frame.of(words)
    assert all(offset % ALIGN == 0 for offset, size in zip(frame.offsets, frame.sizes) if size)
    last = max(o + s for o, s in zip(frame.offsets, frame.sizes))
    assert frame.nbytes == last  # no padding after the last tensor: the bytes, exactly
    message = pack(frame, tensors)
    assert message.numel() == frame.nbytes
    got = unpack(frame, message)
    assert_same(value, got)
    storage = message.untyped_storage().data_ptr()
    views = [t for t in got if torch.is_tensor(t) and t.numel()]
    assert len(views) == 5 and all(t.untyped_storage().data_ptr() == storage for t in views)
    # lazy views whose memory is not their values: a conjugate, a negation (copied, resolved)
    z = torch.randn(3, dtype=torch.complex64)
    for view in (z.conj(), z.conj().imag):
        assert view.is_conj() or view.is_neg()
        view_frame = Frame.of(encode(view)[0])
        got = unpack(view_frame, pack(view_frame, [view]))
        assert torch.equal(got, view.resolve_conj().resolve_neg())


def test_a_lone_tensor_travels_as_its_own_bytes() -> None:
    """One tensor with bytes (beside empty ones and plain items) is sent without a copy: its
    message is its memory, as big as the receiver's buffer; a strided one is copied."""
    x = torch.randn(4, 6)
    for value in (x, (torch.zeros(0, 3), x, None, 2), (x, torch.zeros(0))):
        words, tensors = encode(value)
        frame = Frame.of(words)
        message = pack(frame, tensors)
        assert message.data_ptr() == x.data_ptr() and frame.nbytes == x.numel() * 4
        assert_same(value, unpack(frame, message.clone()))
    strided = x.t()
    frame = Frame.of(encode(strided)[0])
    message = pack(frame, [strided])
    assert message.data_ptr() != x.data_ptr()
    assert torch.equal(unpack(frame, message), strided)


def test_a_description_is_one_message_or_two() -> None:
    short = encode(mixed_value())[0]
    parts = description(short)
    assert len(parts) == 1 and parts[0].numel() == DESCRIPTION_WORDS
    assert words_left(parts[0]) == 0 and words_of(parts[0]) == short
    long = encode(tuple(torch.ones([1] * 8) for _ in range(12)))[0]
    head, rest = description(long)
    assert words_left(head) == rest.numel() == len(long) - (DESCRIPTION_WORDS - 1)
    assert words_of(head, rest) == long
    assert decode(words_of(head, rest)) == decode(long)


def test_a_description_names_dtypes_shapes_and_plain_items() -> None:
    assert render(encode(torch.ones(2, dtype=torch.int8))[0]) == "int8[2]"
    assert (
        render(encode((torch.ones(1, 3), None, 0.5, True))[0]) == "(float32[1, 3], None, 0.5, True)"
    )


def test_what_cannot_travel_is_refused() -> None:
    with pytest.raises(TypeError, match="str"):
        encode((torch.ones(1), "text"))
    with pytest.raises(TypeError, match="dtype"):
        encode(torch.ones(1, dtype=torch.uint16))


def test_an_input_signature_tells_apart_every_layout() -> None:
    x = torch.randn(4, 8)
    base = signature([x, (x, None, 3)])
    assert signature([torch.zeros(4, 8), (torch.ones(4, 8), None, 3)]) == base  # values: same
    for other in (
        [torch.randn(4, 9), (x, None, 3)],  # a longer sequence
        [x.double(), (x, None, 3)],  # a dtype
        [x, (x, 3)],  # the structure
        [x, (x, None, 4)],  # a plain item
        [x],  # fewer micro-batches
    ):
        assert signature(other) != base
    assert signature([[x, "any"], {"a": 1}]) == signature([[x, "any"], {"b": 2}])  # unhashable


def test_each_input_layout_has_a_slot_the_least_recent_one_reused() -> None:
    layouts = Layouts(capacity=2)
    assert layouts.slot_of("a") == (0, True)
    key = ("act", 1, 0)
    layouts.of_step(0, True)[key] = Frame.of(encode(torch.ones(2))[0])
    assert layouts.slot_of("a") == (0, False)
    assert layouts.of_step(0, False) == {key: Frame.of(encode(torch.ones(2))[0])}  # kept
    assert layouts.slot_of("b") == (1, True)
    assert layouts.slot_of("c") == (0, True)  # "a" was the least recently used
    assert layouts.of_step(0, True) == {}  # a new layout in the slot: learned again
    assert layouts.slot_of("b") == (1, False)
