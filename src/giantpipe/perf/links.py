"""How fast boundary tensors cross from one pipeline device to the next, timed on the devices a
process owns: the local executor's devices, or under torch.distributed this rank's device and
its link to the next pipeline rank (no rank touches another rank's device).

Example::

    >>> local_bandwidth(["cpu", "cpu"])          # one device: nothing crosses
    inf
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from giantpipe.perf.measured import probe_link

BLOCK_BYTES = 64 * 2**20
"""What one timed transfer carries: large enough that the link, not its latency, is timed."""


def local_bandwidth(devices: Sequence[str], nbytes: int = BLOCK_BYTES) -> float:
    """Bytes/s of the slowest link between neighbouring devices of this process (the local
    executor's): each pair of different neighbours timed on a copy; inf when all are one."""
    pairs = {(a, b) for a, b in itertools.pairwise(map(torch.device, devices)) if a != b}
    return min((_copy_bandwidth(a, b, nbytes) for a, b in sorted(pairs, key=str)), default=math.inf)


def _copy_bandwidth(src: torch.device, dst: torch.device, nbytes: int) -> float:
    block = torch.empty(nbytes // 4, device=src)
    block.to(dst)  # warm-up: contexts, pinned staging buffers
    _sync(src, dst)
    start = time.perf_counter()
    block.to(dst)
    _sync(src, dst)
    return nbytes / (time.perf_counter() - start)


def neighbour_bandwidth(
    rank: int, workers: int, device: str, nbytes: int = BLOCK_BYTES, group: Any = None
) -> float | None:
    """Bytes/s of this rank's link to the next pipeline rank: ``nbytes`` sent from ``device``
    (its own) over ``group`` (default: the world's), timed by
    :func:`~giantpipe.perf.measured.probe_link`; None for a rank with no next one (the last
    pipeline rank, every rank of another replica).

    Collective over the world (every rank calls it): replica 0's pipeline ranks 0..K-1 (as
    :class:`~giantpipe.engine.distributed.layout.Layout` numbers them, ``workers`` = K) time
    their links one after the other, w to w + 1, so no rank is in two at once.
    """
    mine: float | None = None
    for w in range(workers - 1):
        seconds = probe_link(group, w, w + 1, nbytes, rank, device, repeats=3)
        if rank == w:
            mine = nbytes / seconds if seconds > 0 else math.inf
    return mine


def _sync(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
