"""Wire format of boundary values: a value's layout announced once, then one message per value.

A value crossing a stage boundary is a tensor or a tuple of tensors and plain items (``None``,
``int``, ``float``, ``bool``): AmoebaNet's (current, previous) pair, a decoder's (hidden, encoder
output, padding mask), the gradients coming back (``None`` for an integer mask). Its *layout* is
its description (structure, dtypes, shapes, plain items)::

    [is_tuple, items, item ...]   item: NONE | INT value | FLOAT bits | BOOL value
                                        | TENSOR dtype ndim size_0 .. size_(ndim-1)

Every message starts with a header of ``HEADER_WORDS`` int64 words::

    [n, seed, kind, stage, m, d_0 .. d_58]     n > 0: an announcement of a layout of n words
    [0, seed, kind, stage, m, frame bytes ...] n = 0: a frame, laid out as last announced

It names the value (its mailbox key) and carries the step's dropout seed, which thus travels
down the pipeline with the first activation: no rank needs a broadcast to learn it (and a stale
message from another step is caught by its seed). A *frame* is that header followed by the bytes
of every tensor, each at an offset aligned to ``ALIGN`` bytes, so the receiver's tensors are
views of the one buffer it received into (no copy; bool and any other dtype travel as bytes)::

    frame  | header (512 B) | t_0 bytes | pad | t_1 bytes | pad | ...

The first time a key travels, or when its layout changes (sequence lengths, batch sizes and
tuple layouts may change between steps), the sender announces the new layout (the header with
the description inline, an ``extra`` message for words beyond ``INLINE``), then sends the
frame. Both ends remember each key's frame layout (:class:`KnownLayouts`); in the steady state a
value is one message into a receive buffer of exactly the known size, posted ahead
(:mod:`giantpipe.engine.distributed.p2p`).

Example::

    >>> value = (torch.ones(2, 3), torch.tensor([1, 0]), None)
    >>> words, tensors = encode(value)
    >>> frame = Frame.of(words)
    >>> message = pack(frame, tensors, seed=7, key=("act", 1, 0))
    >>> prefix_of(message)                      # (n, seed, key, frame bytes)
    (0, 7, ('act', 1, 0), 640)
    >>> got = unpack(frame, message)            # views of the message's bytes
    >>> got[0].shape, got[1].dtype, got[2]
    (torch.Size([2, 3]), torch.int64, None)
"""

from __future__ import annotations

import ctypes
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

HEADER_WORDS = 64
HEADER_BYTES = HEADER_WORDS * 8
ALIGN = 64  # bytes: every tensor of a frame starts aligned for any dtype

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


@dataclass(frozen=True)
class TensorSpec:
    """The dtype and shape of a tensor announced by a header."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def encode(value: Any) -> tuple[list[int], list[torch.Tensor]]:
    """The description words of ``value`` and its tensors, in the order their bytes travel."""
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


def decode(words: list[int]) -> Template:
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
            raise ValueError(f"corrupt boundary header: unknown item kind {kind}")
    return is_tuple, items


def allocate(template: Template, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """The value a template describes, with empty tensors, and the byte views to receive into.

    Empty tensors get no byte view: nothing travels for them.
    """
    is_tuple, items = template
    values: list[Any] = []
    buffers: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, TensorSpec):
            t = torch.empty(item.shape, dtype=item.dtype, device=device)
            values.append(t)
            if t.numel():
                buffers.append(as_bytes(t))
        else:
            values.append(item)
    return (tuple(values) if is_tuple else values[0]), buffers


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (a contiguous copy first if it is not)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


_FIXED = 5  # [n, seed, kind, stage, micro-batch]
# A frame's first words, [0, seed, kind, stage, micro-batch, frame bytes], as one struct: written
# and read without a torch op (each costs microseconds, and every value crosses as a frame).
_PREFIX = struct.Struct("<6q")
INLINE = HEADER_WORDS - _FIXED
KINDS = ("act", "grad")


def header(
    words: list[int], seed: int = 0, key: tuple[str, int, int] = ("act", 0, 0)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed-size header message and, for long descriptions, the extra message."""
    head = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    inline = words[:INLINE]
    kind, stage, m = key
    head[:_FIXED] = torch.tensor([len(words), seed, KINDS.index(kind), stage, m])
    head[_FIXED : _FIXED + len(inline)] = torch.tensor(inline, dtype=torch.int64)
    rest = words[INLINE:]
    return head, (torch.tensor(rest, dtype=torch.int64) if rest else None)


def extra_words(head: torch.Tensor) -> int:
    """How many description words follow the header in an extra message."""
    return max(0, int(head[0]) - INLINE)


def words_of(head: torch.Tensor, extra: torch.Tensor | None) -> list[int]:
    """All description words, from the header and the optional extra message."""
    n = int(head[0])
    words: list[int] = head[_FIXED : _FIXED + min(n, INLINE)].tolist()
    if extra is not None:
        words += extra.tolist()
    return words


# ---- frames: the steady state, one message per value ------------------------------------------

Key = tuple[str, int, int]


@dataclass(frozen=True)
class Frame:
    """The layout of a value as one message: its description and where each tensor's bytes lie.

    Example::

        >>> frame = Frame.of(encode(torch.ones(4))[0])
        >>> frame.offsets, frame.nbytes    # 16 bytes after the 512-byte header, padded to 64
        ((512,), 576)
    """

    words: tuple[int, ...]
    template: Template
    offsets: tuple[int, ...]  # byte offset of each tensor item, in order
    sizes: tuple[int, ...]  # its bytes
    nbytes: int  # header included
    head: int = HEADER_BYTES  # bytes of the header; 0 for a payload whose header travels apart

    @classmethod
    def of(cls, words: list[int] | tuple[int, ...], head: int = HEADER_BYTES) -> Frame:
        """The frame of a value described by ``words``; ``head=0`` for a bare payload (the
        tensors' bytes only, the description sent on the host: :mod:`.ordered`)."""
        template = decode(list(words))
        offsets, sizes, end = [], [], head
        for item in template[1]:
            if isinstance(item, TensorSpec):
                size = math.prod(item.shape) * item.dtype.itemsize
                offsets.append(end)
                sizes.append(size)
                end += -(-size // ALIGN) * ALIGN
        return cls(tuple(words), template, tuple(offsets), tuple(sizes), end, head)


def pack(
    frame: Frame,
    tensors: list[torch.Tensor],
    seed: int,
    key: Key,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The one message of a value whose layout is ``frame`` (``tensors`` as :func:`encode`
    lists them): each tensor is copied once, straight into place, strided or not. A bare
    payload (``frame.head == 0``) has no prefix: nothing is written from the host, so a device
    message needs no host-to-device copy (which would wait for the host)."""
    message = torch.empty(frame.nbytes, dtype=torch.uint8, device=device)
    on_host = message.device.type == "cpu"
    if frame.head:
        kind, stage, m = key
        prefix = _PREFIX.pack(0, seed, KINDS.index(kind), stage, m, frame.nbytes)
        if on_host:  # a message per value: one memmove here, not four small torch ops
            ctypes.memmove(message.data_ptr(), prefix, len(prefix))
        else:
            message[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    for t, offset in zip(tensors, frame.offsets):
        size = t.numel() * t.element_size()
        if not size:
            continue
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
    """The value a frame message holds; its tensors are views of ``message`` (no copy)."""
    is_tuple, items = frame.template
    spans = iter(zip(frame.offsets, frame.sizes))
    values: list[Any] = []
    for item in items:
        if isinstance(item, TensorSpec):
            start, size = next(spans)
            values.append(message[start : start + size].view(item.dtype).view(item.shape))
        else:
            values.append(item)
    return tuple(values) if is_tuple else values[0]


def prefix_of(message: torch.Tensor) -> tuple[int, int, Key, int]:
    """``(n, seed, key, frame bytes)`` of a received message: n > 0 for an announcement of n
    description words (frame bytes then 0), n = 0 for a frame."""
    if message.device.type == "cpu" and message.is_contiguous():
        raw = ctypes.string_at(message.data_ptr(), _PREFIX.size)
    else:
        raw = bytes(message[: _PREFIX.size].cpu().tolist())
    n, seed, kind, stage, m, size = _PREFIX.unpack(raw)
    return n, seed, (KINDS[kind], stage, m), (size if n == 0 else 0)


@dataclass
class KnownLayouts:
    """Each key's frame layout as last announced: what this rank sent, what it received.

    Both ends of a key hold the same entry after every step, so a receiver can post a buffer of
    exactly the frame's size before the value exists, and a sender knows that it did.

    Example::

        >>> known = KnownLayouts()
        >>> known.changed(("act", 1, 0), encode(torch.ones(2))[0])   # never sent: announce
        True
        >>> known.sent[("act", 1, 0)] = Frame.of(encode(torch.ones(2))[0])
        >>> known.changed(("act", 1, 0), encode(torch.zeros(2))[0])  # same layout: a frame
        False
    """

    sent: dict[Key, Frame] = field(default_factory=dict)
    received: dict[Key, Frame] = field(default_factory=dict)

    def changed(self, key: Key, words: list[int]) -> bool:
        """Whether sending a value of layout ``words`` under ``key`` needs an announcement."""
        frame = self.sent.get(key)
        return frame is None or frame.words != tuple(words)
