"""What a process reads from disk: its bytes read (``/proc/self/io``), files taken out of the
page cache so that the next read of them goes to the disk and counts (Linux; on a file system
without a page cache to drop, tmpfs, nothing counts as read), and a rank reading its share of a
model's weights as ``trainer.init_from`` does.

Example::

    drop_cache(Path("llama"))
    before = disk_bytes_read()
    source.read(names)
    disk_bytes_read() - before          # the bytes of ``names``, and the read-ahead around them
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.checkpoint.safetensors_files import raw_bytes
from giantpipe.checkpoint.weights import open_weights
from giantpipe.runner.run_state.init_from import read_share


def io_counters() -> dict[str, int]:
    """This process's ``/proc/self/io``: ``rchar`` (bytes through read(), the page cache
    included), ``read_bytes`` (bytes from the disk, a mapped file's page faults included)."""
    lines = Path("/proc/self/io").read_text().splitlines()
    return {k: int(v) for k, v in (line.split(":") for line in lines)}


def disk_bytes_read() -> int:
    """This process's bytes read from the disk so far (``read_bytes``)."""
    return io_counters()["read_bytes"]


def drop_cache(*paths: Path) -> None:
    """Takes the files at ``paths`` (files, or every file below a folder) out of the page
    cache, written back first."""
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def pipeline_shares(names: list[str], ranks: int) -> list[list[str]]:
    """A Hugging Face causal LM's tensor names in ``ranks`` contiguous shares, as pipeline ranks
    hold them: its decoder layers (``model.layers.I.``) evenly, the embedding with the first,
    everything after the layers (final norm, head) with the last.

    >>> pipeline_shares(["model.embed.w", "model.layers.0.w", "model.layers.1.w", "lm_head.w"], 2)
    [['model.embed.w', 'model.layers.0.w'], ['model.layers.1.w', 'lm_head.w']]
    """
    layered = [n for n in names if n.startswith("model.layers.")]
    layers = 1 + max(int(n.split(".")[2]) for n in layered)
    shares: list[list[str]] = [[] for _ in range(ranks)]
    for name in names:
        if name.startswith("model.layers."):
            shares[int(name.split(".")[2]) * ranks // layers].append(name)
        else:
            shares[0 if "embed" in name else ranks - 1].append(name)
    return shares


Layouts = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Tensor name -> dtype and shape."""


def read_my_share(source: Path, shares: list[Layouts]) -> dict[str, Any]:
    """Collective: this rank reads ``shares[rank]`` (name -> dtype and shape) from ``source`` as
    ``trainer.init_from`` does (:func:`giantpipe.runner.run_state.init_from.read_share`), the
    files dropped from the page cache first (rank 0, before any rank starts). Returns the
    share's bytes, the bytes read from disk (``read``) and through read() (``rchar``), and each
    tensor's sha256."""
    rank = dist.get_rank()
    mine = {n: torch.empty(s, dtype=d, device="meta") for n, (d, s) in shares[rank].items()}
    if rank == 0:
        drop_cache(source)
    dist.barrier()
    open_weights(source)  # the modules it imports (transformers) are the process's, not the share
    before = io_counters()
    found = read_share(source, mine, {rank: list(mine)})
    after = io_counters()
    return {
        "share": sum(t.nbytes for t in found.values()),
        "read": after["read_bytes"] - before["read_bytes"],
        "rchar": after["rchar"] - before["rchar"],
        "digests": {n: digest(t) for n, t in found.items()},
    }


def digest(tensor: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes (to compare tensors read in different processes)."""
    return hashlib.sha256(raw_bytes(tensor)).hexdigest()


def read_ahead_bytes() -> int:
    """The most this machine's disks read ahead of a read (``read_ahead_kb``; 8 MiB if unknown):
    what a read of a mapped or buffered range may fetch beyond it, on each side."""
    found = [int(p.read_text()) for p in Path("/sys/block").glob("*/queue/read_ahead_kb")]
    return max(found, default=8192) * 1024
