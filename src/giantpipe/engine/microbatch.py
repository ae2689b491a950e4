"""Micro-batching: split a mini-batch into M micro-batches and gather outputs back.

A batch is a tensor or a tuple of tensors that share their first (batch) dimension. Integer and
bool tensors (labels, token ids, padding masks) travel with the float ones and never require
grad. Non-tensor items (``None``, numbers) are passed unchanged to every micro-batch.

Example::

    >>> x = torch.arange(10).view(10, 1).float()
    >>> [m.shape[0] for m in scatter(x, chunks=4)]
    [3, 3, 2, 2]
    >>> gather(scatter(x, chunks=4)).equal(x)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Tensors = tuple[Any, ...]
TensorOrTensors = torch.Tensor | Tensors


def as_tuple(batch: TensorOrTensors) -> Tensors:
    """Views a batch as a tuple (a lone tensor becomes a 1-tuple)."""
    return (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)


def batch_size(batch: TensorOrTensors) -> int:
    """The size of the first dimension shared by the batch's tensors.

    Raises TypeError when the batch holds no tensor and ValueError when tensors disagree.
    """
    if not isinstance(batch, (torch.Tensor, tuple, list)):
        raise TypeError(f"expected a tensor or a tuple of tensors, got {type(batch).__name__}")
    sizes = {t.shape[0] for t in as_tuple(batch) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not sizes:
        raise TypeError("a batch must hold at least one tensor with a batch dimension")
    if len(sizes) > 1:
        raise ValueError(f"tensors in one batch disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def split_sizes(total: int, chunks: int) -> list[int]:
    """Sizes of ``chunks`` micro-batches for a batch of ``total``: as even as possible.

    The first ``total % chunks`` micro-batches get one more sample, so every micro-batch exists
    (unlike ``torch.chunk``, which may return fewer chunks than asked for).

    >>> split_sizes(10, 4)
    [3, 3, 2, 2]
    """
    if chunks < 1:
        raise ValueError(f"number of chunks must be positive integer (chunks: {chunks})")
    if chunks > total:
        raise ValueError(
            f"chunks ({chunks}) is larger than the batch size ({total}): every micro-batch "
            "needs at least one sample; lower chunks or raise the batch size"
        )
    base, extra = divmod(total, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def scatter(batch: TensorOrTensors, chunks: int) -> list[TensorOrTensors]:
    """Splits a batch into ``chunks`` micro-batches along dimension 0.

    A tensor batch gives tensors, a tuple batch gives tuples of the same length.
    """
    sizes = split_sizes(batch_size(batch), chunks)
    if isinstance(batch, torch.Tensor):
        return list(batch.split(sizes))
    columns = [
        item.split(sizes) if isinstance(item, torch.Tensor) and item.dim() > 0 else [item] * chunks
        for item in batch
    ]
    return [tuple(col[i] for col in columns) for i in range(chunks)]


def gather(outputs: Sequence[TensorOrTensors]) -> TensorOrTensors:
    """Concatenates micro-batch outputs back into one batch (inverse of :func:`scatter`).

    Scalars (0-dim tensors) and non-tensors cannot be concatenated; the first one is kept.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return (
            torch.cat([o for o in outputs if isinstance(o, torch.Tensor)])
            if first.dim() > 0
            else first
        )
    gathered = []
    for i, item in enumerate(first):
        if isinstance(item, torch.Tensor) and item.dim() > 0:
            gathered.append(torch.cat([out[i] for out in outputs]))
        else:
            gathered.append(item)
    return tuple(gathered)


def to_device(batch: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    """Moves every tensor of a batch to ``device`` (non-blocking; no copy if already there)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return tuple(
        t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in batch
    )


class CopyStreams:
    """Moves values between CUDA devices on side streams, so that a stage's compute stream
    never waits for a copy it does not consume (torchgpipe's copy streams, the same care).

    The copy runs on a copy stream of each device. The source tensor is marked in use on the
    source's copy stream (``record_stream``), so the allocator does not hand its memory to the
    source stage's next micro-batch before the copy has read it; the copy is marked in use on the
    destination's compute stream, which waits for the copy before the stage reads it. Values
    already on the device, or on no CUDA device, move as :func:`to_device` moves them.

    Example (on two GPUs)::

        streams = CopyStreams()
        x1 = streams.arrive(stage0(x0), torch.device("cuda:1"))   # stage 0 goes on at once
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The copy stream of ``device`` (made on first use)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def arrive(self, batch: TensorOrTensors, device: torch.device) -> TensorOrTensors:
        """``batch`` on ``device``, its cross-device CUDA copies made on the copy streams."""
        if device.type != "cuda":
            return to_device(batch, device)
        moved = tuple(self._move(t, device) for t in as_tuple(batch))
        return moved[0] if isinstance(batch, torch.Tensor) else moved

    def _move(self, t: Any, device: torch.device) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.device == device:
            return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t
        source, target = self.stream(t.device), self.stream(device)
        compute = torch.cuda.current_stream(device)
        # The copy starts after the producer's kernels (on the source's default stream).
        source.wait_stream(torch.cuda.default_stream(t.device))
        with torch.cuda.stream(source), torch.cuda.stream(target):
            moved = t.to(device, non_blocking=True)
        t.record_stream(source)
        compute.wait_stream(target)
        moved.record_stream(compute)
        return moved


def nbytes(batch: TensorOrTensors) -> int:
    """Bytes held by the tensors of a batch (used for activation accounting)."""
    return sum(t.numel() * t.element_size() for t in as_tuple(batch) if isinstance(t, torch.Tensor))
