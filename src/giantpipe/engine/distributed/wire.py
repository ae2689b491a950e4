"""Boundary values on the wire: each value's description learned once, then its bytes alone.

A value crossing a stage boundary (a tensor, or a tuple of tensors and ``None``, ``int``,
``float``, ``bool`` items) is described (:func:`encode`) into its :class:`Frame`: a lone tensor
travels as itself, a tuple packed into one message (:func:`pack`) and taken apart as views of the
buffer it arrived in (:func:`unpack`). :class:`Layouts` is what both ends of every boundary
remember across steps, per layout of the step's inputs (docs/engine.md#the-transport).

    >>> value = (torch.ones(2, 3), torch.tensor([1, 0]), None)
    >>> words, tensors = encode(value)
    >>> frame = Frame.of(words)
    >>> got = unpack(frame, pack(frame, tensors))
    >>> got[0].shape, got[1].dtype, got[2], frame.nbytes
    (torch.Size([2, 3]), torch.int64, None, 80)
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 64  # bytes: every tensor of a packed message starts aligned for any dtype
DESCRIPTION_WORDS = 64  # int64 words of a description's first host message

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
NONE, INT, FLOAT, BOOL, TENSOR = range(5)

# A decoded item: None / int / float / bool as is, a tensor as (dtype, shape).
Template = tuple[bool, list[Any]]
Key = tuple[str, int, int]


@dataclass(frozen=True)
class TensorSpec:
    """The dtype and shape of a tensor a description announces."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def encode(value: Any) -> tuple[list[int], list[torch.Tensor]]:
    """The description words of ``value`` and its tensors, in the order their bytes travel::

    [is_tuple, items, item ...]   item: NONE | INT value | FLOAT bits | BOOL value
                                        | TENSOR dtype ndim size_0 .. size_(ndim-1)
    """
    is_tuple = not isinstance(value, torch.Tensor)
    items = tuple(value) if is_tuple else (value,)
    words = [int(is_tuple), len(items)]
    tensors: list[torch.Tensor] = []
    for item in items:
        words += _encode_item(item)
        if isinstance(item, torch.Tensor):
            tensors.append(item)
    return words, tensors


def _encode_item(item: Any) -> list[int]:
    if item is None:
        return [NONE]
    if isinstance(item, bool):  # before int: bool is an int subclass
        return [BOOL, int(item)]
    if isinstance(item, int):
        return [INT, item]
    if isinstance(item, float):
        return [FLOAT, struct.unpack("<q", struct.pack("<d", item))[0]]
    if isinstance(item, torch.Tensor):
        if item.dtype not in _CODE:
            raise TypeError(f"cannot send a tensor of dtype {item.dtype} between stages")
        return [TENSOR, _CODE[item.dtype], item.dim(), *item.shape]
    raise TypeError(
        f"a stage boundary carries tensors, None, int, float or bool; got {type(item).__name__}"
    )


def decode(words: Sequence[int]) -> Template:
    """Parses description words back into a template (the inverse of :func:`encode`)."""
    is_tuple, count = bool(words[0]), words[1]
    items: list[Any] = []
    i = 2
    for _ in range(count):
        kind = words[i]
        if kind == NONE:
            items.append(None)
            i += 1
        elif kind in (INT, BOOL):
            items.append(words[i + 1] if kind == INT else bool(words[i + 1]))
            i += 2
        elif kind == FLOAT:
            items.append(struct.unpack("<d", struct.pack("<q", words[i + 1]))[0])
            i += 2
        elif kind == TENSOR:
            ndim = words[i + 2]
            shape = tuple(words[i + 3 : i + 3 + ndim])
            items.append(TensorSpec(DTYPES[words[i + 1]], shape))
            i += 3 + ndim
        else:
            raise ValueError(f"corrupt boundary description: unknown item kind {kind}")
    return is_tuple, items


def render(words: Sequence[int]) -> str:
    """A description as a person reads it.

    >>> render(encode((torch.ones(2, 3), None, 4))[0])
    '(float32[2, 3], None, 4)'
    """
    is_tuple, items = decode(words)
    text = ", ".join(map(str, items))
    return f"({text})" if is_tuple else text


def description(words: Sequence[int]) -> list[torch.Tensor]:
    """The host messages that carry ``words``: ``[n, words ...]`` in ``DESCRIPTION_WORDS``
    int64 words, then the words that did not fit, if any (:func:`words_left`).

    >>> [m.numel() for m in description(list(range(70)))]
    [64, 7]
    """
    head = torch.zeros(DESCRIPTION_WORDS, dtype=torch.int64)
    inline = list(words[: DESCRIPTION_WORDS - 1])
    head[0] = len(words)
    head[1 : 1 + len(inline)] = torch.tensor(inline, dtype=torch.int64)
    rest = list(words[DESCRIPTION_WORDS - 1 :])
    return [head, torch.tensor(rest, dtype=torch.int64)] if rest else [head]


def words_left(head: torch.Tensor) -> int:
    """How many words of a description follow its first message."""
    return max(0, int(head[0]) - (DESCRIPTION_WORDS - 1))


def words_of(head: torch.Tensor, rest: torch.Tensor | None = None) -> list[int]:
    """Every word of a description, from its first message and the rest (the inverse of
    :func:`description`)."""
    n = int(head[0])
    words: list[int] = head[1 : 1 + min(n, DESCRIPTION_WORDS - 1)].tolist()
    return words + (rest.tolist() if rest is not None else [])


@dataclass(frozen=True)
class Frame:
    """Where the bytes of a value of one description lie in its message.

    Example::

        >>> frame = Frame.of(encode((torch.ones(4), torch.ones(2, dtype=torch.int8)))[0])
        >>> frame.offsets, frame.nbytes    # 16 bytes, padded to 64; then 2
        ((0, 64), 66)
    """

    words: tuple[int, ...]
    template: Template
    offsets: tuple[int, ...]  # byte offset of each tensor item, in order
    sizes: tuple[int, ...]  # its bytes
    nbytes: int  # the message's: up to the last tensor's last byte

    @classmethod
    def of(cls, words: Sequence[int]) -> Frame:
        """The frame of a value described by ``words``."""
        template = decode(words)
        offsets, sizes, end = [], [], 0
        for item in template[1]:
            if isinstance(item, TensorSpec):
                size = math.prod(item.shape) * item.dtype.itemsize
                start = -(-end // ALIGN) * ALIGN if size else end  # an empty one takes no room
                offsets.append(start)
                sizes.append(size)
                end = start + size
        return cls(tuple(words), template, tuple(offsets), tuple(sizes), end)


def pack(
    frame: Frame, tensors: list[torch.Tensor], device: torch.device | None = None
) -> torch.Tensor:
    """The message of a value whose layout is ``frame`` (``tensors`` as :func:`encode` lists
    them), on ``device`` (default: the tensors'). A value whose bytes are one tensor's, in
    plain memory on that device, is that tensor's bytes: no copy. Otherwise each tensor is
    copied once, straight into place, by a kernel on a device (no host round trip)."""
    filled = [(t, o) for t, o, s in zip(tensors, frame.offsets, frame.sizes) if s]
    if len(filled) == 1:
        t = filled[0][0]
        if (device is None or t.device == device) and _plain_memory(t):
            return t.detach().reshape(-1).view(torch.uint8)
    if device is None:
        device = filled[0][0].device if filled else torch.device("cpu")
    message = torch.empty(frame.nbytes, dtype=torch.uint8, device=device)
    on_host = message.device.type == "cpu"
    for t, offset in filled:
        size = t.numel() * t.element_size()
        if on_host and t.device.type == "cpu" and _plain_memory(t):
            ctypes.memmove(message.data_ptr() + offset, t.data_ptr(), size)
        else:
            message[offset : offset + size].view(t.dtype).view(t.shape).copy_(t)
    return message


def _plain_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are its memory as laid out: contiguous, and no lazy conjugate or
    negation a view may carry (``x.conj()`` shares ``x``'s memory; a copy would resolve it)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def unpack(frame: Frame, message: torch.Tensor) -> Any:
    """The value a message holds; its tensors are views of ``message`` (no copy)."""
    is_tuple, items = frame.template
    spans = iter(zip(frame.offsets, frame.sizes))
    values: list[Any] = []
    for item in items:
        if isinstance(item, TensorSpec):
            start, size = next(spans)
            if not size:  # no bytes, and maybe no aligned place in the message to view
                values.append(torch.empty(item.shape, dtype=item.dtype, device=message.device))
                continue
            values.append(message[start : start + size].view(item.dtype).view(item.shape))
        else:
            values.append(item)
    return tuple(values) if is_tuple else values[0]


def signature(values: Sequence[Any]) -> tuple[Hashable, ...]:
    """The layout of each value (a step's micro-batches), hashable: a tensor's dtype and shape,
    a tuple's items, any other item itself (its type where it cannot be hashed).

    >>> signature([torch.ones(2, 3), (torch.ones(1), None, 4)])
    ((torch.float32, (2, 3)), ((torch.float32, (1,)), None, 4))
    """

    def one(value: Any) -> Hashable:
        if isinstance(value, torch.Tensor):
            return (value.dtype, tuple(value.shape))
        if isinstance(value, (tuple, list)):
            return tuple(one(v) for v in value)
        return value if isinstance(value, Hashable) else type(value).__name__

    return tuple(one(v) for v in values)


@dataclass
class Layouts:
    """What every rank of a pipeline knows across steps: each boundary value's frame, per
    layout of the step's inputs (a *slot*), and how many steps ran.

    The rank holding stage 0 names each step's input layout by a slot (:meth:`slot_of`) and
    tells the others; a new slot's frames are learned in that step, from descriptions sent on
    the host, and every later step with the same inputs' layout moves bytes alone. At most
    ``capacity`` layouts are kept; a new one takes the slot of the least recently used.

    Example::

        >>> layouts = Layouts(capacity=2)
        >>> [layouts.slot_of(s) for s in ("a", "b", "a", "c", "b")]
        [(0, True), (1, True), (0, False), (1, True), (0, True)]
    """

    capacity: int = 16
    steps: int = 0
    frames: dict[int, dict[Key, Frame]] = field(default_factory=dict)
    _slots: OrderedDict[Hashable, int] = field(default_factory=OrderedDict)

    def slot_of(self, layout: Hashable) -> tuple[int, bool]:
        """The slot of an input layout, and whether it is new (its frames to be learned)."""
        if layout in self._slots:
            self._slots.move_to_end(layout)
            return self._slots[layout], False
        if len(self._slots) < self.capacity:
            slot = len(self._slots)
        else:
            _, slot = self._slots.popitem(last=False)
        self._slots[layout] = slot
        return slot, True

    def of_step(self, slot: int, new: bool) -> dict[Key, Frame]:
        """The frames of a step that runs in ``slot``: empty (to be learned) if ``new``."""
        if new or slot not in self.frames:
            self.frames[slot] = {}
        return self.frames[slot]
