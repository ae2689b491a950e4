"""Wire format of boundary values: a description first, then the raw bytes of each tensor.

A value crossing a stage boundary is a tensor or a tuple of tensors and plain items (``None``,
``int``, ``float``, ``bool``): AmoebaNet's (current, previous) pair, a decoder's (hidden, encoder
output, padding mask), the gradients coming back (``None`` for an integer mask). Nothing about
it is fixed between steps, so every message says what follows::

    header  int64[HEADER_WORDS]   [n, seed, kind, stage, m, d_0 .. d_58]   inline description
    extra   int64[n - 59]         d_59 ..                   only when the description is longer
    bytes   uint8[nbytes(t_i)]    one message per non-empty tensor, in order

The header names the value (its mailbox key), so a receiver takes messages in the order the
sender sent them, whatever order it needs them in. It also carries the step's dropout seed,
which thus travels down the pipeline with the first activation: no rank needs a broadcast to
learn it (and a stale message from another step is caught by its seed).

The description is ``[is_tuple, items, item ...]`` with one of these per item::

    NONE | INT value | FLOAT bits | BOOL value | TENSOR dtype ndim size_0 .. size_(ndim-1)

Tensors travel as bytes (any dtype, bool included: the transport never converts), and the
receiver allocates exactly what the header announces, so sequence lengths, batch sizes and
tuple layouts may change from one step to the next.

Example::

    >>> words, tensors = encode((torch.ones(2, 3), torch.tensor([1, 0]), None))
    >>> template = decode(words)
    >>> value, buffers = allocate(template, torch.device("cpu"))
    >>> for src, dst in zip(tensors, buffers):
    ...     dst.copy_(as_bytes(src))
    >>> value[0].shape, value[1].dtype, value[2]
    (torch.Size([2, 3]), torch.int64, None)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

HEADER_WORDS = 64

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


def seed_of(head: torch.Tensor) -> int:
    """The step seed a header carries."""
    return int(head[1])


def key_of(head: torch.Tensor) -> tuple[str, int, int]:
    """The mailbox key (kind, stage, micro-batch) of the value a header announces."""
    kind, stage, m = head[2:_FIXED].tolist()
    return KINDS[kind], stage, m


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
