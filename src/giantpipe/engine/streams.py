"""Where each worker of the local executor runs on CUDA: its device, its stream, and the joins
that order its stream with the caller's.

In PyTorch the current device and the current stream are both thread-local: a fresh worker
thread starts on cuda:0 with that device's default stream, whatever the caller had made current.
So every worker enters its own :class:`Lane` (device and stream) before its first action
(:func:`enter_lane`), on a pool thread as on the caller's own thread.

Which stream (:func:`own_streams`, decided per phase over the workers that run in this process):

- a worker alone on its CUDA device runs on the caller's current stream of that device: its
  kernels are ordered with what the caller did before (inputs, the optimizer's update) and
  after (reading outputs, ``p.grad`` and the loss), with no join at all;
- workers sharing a CUDA device (K stages on one GPU) each get a stream of their own on it, so
  that their kernels may overlap and the CUDA events that time them
  (:class:`~giantpipe.engine.stats.CudaClock`) time one worker each. Those streams are joined
  with the caller's at both ends of a phase::

      caller's stream  --(join_from_caller)-->  worker streams: the phase's actions
      caller's stream  <--(join_to_caller)---   worker streams        (outputs, p.grad, loss)

  A value handed between two of them waits for the event its producer recorded and is marked
  in use on the consumer's stream (:class:`~giantpipe.engine.microbatch.CopyStreams`).

Memory allocated on a worker's stream (activations, gradients, ``p.grad``) and freed later by
the caller needs no ``record_stream``: the allocator hands a block back only to allocations on
the stream it came from, that stream's next phase starts with a wait for the caller's stream
(so after every kernel the caller queued reading the block), and a worker's stream is the same
object step after step (:func:`worker_stream`).

None of this can run without a GPU: the stream objects, ``wait_stream`` and the thread-local
current stream are proven by ``benchmarks/gpu_check.py``. On CPU, a lane is its device alone
and entering it does nothing; the tests check which worker enters which lane, and the table
of :func:`own_streams`.

Example::

    >>> own_streams([torch.device("cuda:0"), torch.device("cuda:0"), torch.device("cuda:1")])
    [True, True, False]
    >>> lanes = plan_lanes([torch.device("cpu"), torch.device("cpu")])
    >>> [(lane.worker, lane.stream) for lane in lanes]
    [(0, None), (1, None)]
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, NamedTuple

import torch

__all__ = [
    "Lane",
    "enter_lane",
    "join_from_caller",
    "join_to_caller",
    "own_streams",
    "plan_lanes",
    "worker_stream",
]


class Lane(NamedTuple):
    """Where one worker runs: its device and, on CUDA, its stream."""

    worker: int
    device: torch.device
    stream: Any = None  # torch.cuda.Stream on CUDA, None elsewhere
    own: bool = False  # a stream of its own, joined with the caller's at both ends of a phase


def own_streams(devices: Sequence[torch.device | None]) -> list[bool]:
    """Which workers get a stream of their own: those sharing a CUDA device with another worker
    of the phase (``None``: a worker that runs no action here, e.g. another rank's).

    >>> cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    >>> own_streams([cpu, cpu]), own_streams([gpu, None, gpu])
    ([False, False], [True, False, True])
    """
    cuda = [d for d in devices if d is not None and d.type == "cuda"]
    if not cuda:
        return [False] * len(devices)  # CPU stand-ins: nothing to count, every phase
    counts = Counter(cuda)
    return [d is not None and counts[d] > 1 for d in devices]


_streams: dict[tuple[torch.device, int], Any] = {}
_streams_guard = threading.Lock()


def worker_stream(device: torch.device, worker: int) -> Any:
    """Worker ``worker``'s own stream on ``device``: the same object step after step.

    The caching allocator keeps freed blocks per stream; a new stream per step (the stream
    pool hands them out round-robin) would strand each step's blocks in another pool.
    """
    with _streams_guard:
        stream = _streams.get((device, worker))
        if stream is None:
            stream = _streams[(device, worker)] = torch.cuda.Stream(device)
        return stream


def plan_lanes(devices: Sequence[torch.device | None]) -> list[Lane | None]:
    """The lane of each worker of a phase (``devices[w]``: worker w's device, ``None`` where it
    runs nothing). Call it in the caller's thread: a lone worker on a CUDA device takes the
    caller's current stream of that device."""
    own = own_streams(devices)
    lanes: list[Lane | None] = []
    for worker, (device, mine) in enumerate(zip(devices, own, strict=True)):
        if device is None:
            lanes.append(None)
        elif device.type != "cuda":
            lanes.append(Lane(worker, device))
        else:
            stream = worker_stream(device, worker) if mine else torch.cuda.current_stream(device)
            lanes.append(Lane(worker, device, stream, mine))
    return lanes


def enter_lane(stack: ExitStack, lane: Lane) -> None:
    """Makes ``lane``'s device and stream current on the calling thread until ``stack`` closes
    (a no-op off CUDA).

    Example::

        with ExitStack() as stack:
            enter_lane(stack, lane)     # torch.cuda.current_device() == lane.device.index
            ...                         # kernels go to lane.stream
    """
    if lane.stream is None:
        return
    stack.enter_context(torch.cuda.device(lane.device))
    stack.enter_context(torch.cuda.stream(lane.stream))


def join_from_caller(lanes: Sequence[Lane | None]) -> None:
    """Before a phase, in the caller's thread: every own stream waits for what the caller's
    current stream of its device has queued (the inputs were produced there)."""
    for lane in lanes:
        if lane is not None and lane.own:
            lane.stream.wait_stream(torch.cuda.current_stream(lane.device))


def join_to_caller(lanes: Sequence[Lane | None]) -> None:
    """After a phase, in the caller's thread: the caller's current stream of each device waits
    for the own streams there (outputs, ``p.grad`` and the loss are read on it)."""
    for lane in lanes:
        if lane is not None and lane.own:
            torch.cuda.current_stream(lane.device).wait_stream(lane.stream)
