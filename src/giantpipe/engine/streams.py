"""Where each worker runs on CUDA: its device, its stream, and the joins that order its stream
with the caller's.

Device and stream are thread-local in PyTorch, so every worker enters its :class:`Lane` before
its first action; a worker alone on its GPU takes the caller's stream, workers sharing one get
streams of their own, joined with the caller's: docs/engine-internals.md#streams-on-cuda.

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
