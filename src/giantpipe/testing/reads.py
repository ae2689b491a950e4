"""What a process reads from disk: its bytes read (``/proc/self/io``), and files taken out of
the page cache so that the next read of them goes to the disk and counts. Linux only; on a file
system without a page cache to drop (tmpfs) nothing counts as read.

Example::

    drop_cache(Path("llama"))
    before = disk_bytes_read()
    source.read(names)
    disk_bytes_read() - before          # the bytes of ``names``, and the read-ahead around them
"""

from __future__ import annotations

import os
from pathlib import Path


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
