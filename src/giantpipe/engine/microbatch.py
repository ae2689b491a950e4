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

import threading
from collections.abc import Sequence
from typing import Any

import torch

from giantpipe.engine.spec import SpecError

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
    (unlike ``torch.chunk``, which may return fewer chunks than asked for). An empty batch is
    one empty micro-batch. More chunks than samples is a :class:`SpecError` naming
    ``pipeline.chunks`` (a training step needs M micro-batches; a forward without gradients
    asks for fewer, :func:`forward_chunks`).

    >>> split_sizes(10, 4)
    [3, 3, 2, 2]
    """
    if chunks < 1:
        raise ValueError(f"number of chunks must be positive integer (chunks: {chunks})")
    if chunks > max(total, 1):
        raise SpecError(
            "pipeline.chunks",
            f"chunks ({chunks}) is larger than the batch size ({total}): every micro-batch of "
            "a training step needs at least one sample; lower chunks or raise the batch size "
            "(a forward without gradients takes any batch)",
        )
    base, extra = divmod(total, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def forward_chunks(total: int, chunks: int) -> int:
    """How many micro-batches a forward without gradients splits a batch of ``total`` into:
    M (``chunks``), or one per sample when the batch is smaller, as torchgpipe does (one empty
    micro-batch for an empty batch). Derived per call: M stays the spec's.

    >>> forward_chunks(32, 4), forward_chunks(3, 4), forward_chunks(0, 4)
    (4, 3, 1)
    """
    return max(1, min(chunks, total))


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
    """Moves every tensor of a batch to ``device`` (no copy if already there).

    Copies to a CUDA device are non-blocking; copies to the host are not: a non-blocking copy
    from CUDA lands in pinned memory the host could read before the kernel has written it.
    """
    blocking = device.type != "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=not blocking)
    return tuple(
        t.to(device, non_blocking=not blocking) if isinstance(t, torch.Tensor) else t for t in batch
    )


Ready = dict[torch.device, Any]  # CUDA device -> event recorded on the producer's stream there


def cuda_devices(batch: Any) -> set[torch.device]:
    """The CUDA devices holding a tensor of ``batch`` (none for host values).

    >>> cuda_devices((torch.ones(2), None))
    set()
    """
    return {t.device for t in as_tuple(batch) if isinstance(t, torch.Tensor) and t.is_cuda}


def record_event(device: torch.device) -> Any:
    """A CUDA event recorded now on the calling thread's current stream of ``device``: it
    completes when the kernels queued there so far have run."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class CopyStreams:
    """Hands values between the CUDA streams and devices of the workers, so that a stage's
    stream waits for exactly the value it consumes, never for a copy it does not consume nor
    for its producer's later work (torchgpipe's copy streams, the same care).

    The producer records, in its own thread right after computing a value, an event on its
    current stream (:meth:`ready`); the value's consumer waits on that event only
    (:meth:`arrive`). Waiting on the producer's whole stream instead would also wait for the
    micro-batches it computed after this one, and serialise the pipeline's fill.

    - Same device (workers sharing a GPU, each on its own stream): the consumer's stream waits
      for the event and the tensor is marked in use on it (``record_stream``), so the allocator
      does not hand its memory to the producer's next micro-batch while the consumer reads it.
    - Another CUDA device: the copy runs on a copy stream of each device, after the event. The
      source is marked in use on the source's copy stream; the copy, made on the destination's
      copy stream, is marked in use on the consumer's stream, which waits for an event recorded
      after the copy.
    - Host values move as :func:`to_device` moves them; a value with no event (a distributed
      rank's received value, already on its device) is taken as it is.

    None of the stream logic runs without a GPU (``benchmarks/gpu_check.py`` proves it); on
    CPU :meth:`ready` records nothing and :meth:`arrive` is :func:`to_device`.

    Example (on two GPUs)::

        streams = CopyStreams()
        y = stage0(x0)
        ready = streams.ready(y)                                      # in stage 0's thread
        x1 = streams.arrive(y, torch.device("cuda:1"), ready)         # in stage 1's thread
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._guard = threading.Lock()  # workers of several threads ask for streams

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The copy stream of ``device`` (made on first use)."""
        with self._guard:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]

    def ready(self, batch: Any) -> Ready:
        """Events marking ``batch`` as computed, one per CUDA device holding a tensor of it,
        recorded on the calling thread's current streams: call it in the producer's thread
        right after the value was computed (empty, and free, for host values)."""
        return {device: record_event(device) for device in cuda_devices(batch)}

    def arrive(
        self, batch: TensorOrTensors, device: torch.device, ready: Ready | None = None
    ) -> TensorOrTensors:
        """``batch`` on ``device``, for the calling thread's current stream there; ``ready``:
        what :meth:`ready` returned for it in the producer's thread."""
        if device.type != "cuda":
            return to_device(batch, device)
        moved = tuple(self._move(t, device, ready or {}) for t in as_tuple(batch))
        return moved[0] if isinstance(batch, torch.Tensor) else moved

    def _move(self, t: Any, device: torch.device, ready: Ready) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not t.is_cuda:
            return t.to(device, non_blocking=True)  # from the host: read at once
        event = ready.get(t.device)
        if t.device == device:
            if event is not None:
                _consume_on(torch.cuda.current_stream(device), event, t)
            return t
        return self._copy(t, device, event)

    def _copy(self, t: torch.Tensor, device: torch.device, event: Any) -> torch.Tensor:
        """Copies ``t`` to another CUDA device on the copy streams, after ``event`` only."""
        source, target = self.stream(t.device), self.stream(device)
        if event is not None:
            source.wait_event(event)
        else:  # a producer that recorded nothing: its stream is this thread's current one
            source.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(source), torch.cuda.stream(target):
            moved = t.to(device, non_blocking=True)
            copied = record_event(device)  # on the target's copy stream, current here
        t.record_stream(source)
        _consume_on(torch.cuda.current_stream(device), copied, moved)
        return moved


def _consume_on(stream: Any, event: Any, t: torch.Tensor) -> None:
    # The consumer's stream waits for the value, and the allocator keeps the value's memory
    # until the kernels the consumer queues on that stream have read it.
    stream.wait_event(event)
    t.record_stream(stream)


def nbytes(batch: TensorOrTensors) -> int:
    """Bytes held by the tensors of a batch (used for activation accounting)."""
    return sum(t.numel() * t.element_size() for t in as_tuple(batch) if isinstance(t, torch.Tensor))
