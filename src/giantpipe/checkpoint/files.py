"""Files written whole or not at all (a temporary file, fsync, ``os.replace``), fsynced
directories, and the content hashes every file of a checkpoint is committed with: a small file
hashed whole, a data file per :data:`BLOCK` bytes (so a read checks only the blocks it touches).

Example::

    atomic_save(state, "ckpt/model.pt")           # the old file or the new one, never torn
    describe(Path("ckpt/step000000100-3f9c2a"), [".metadata"])   # {name: {"bytes", "sha256"}}
    block_record(Path("ckpt/step000000100-3f9c2a/__0_0.distcp"))   # {"bytes", "blocks"}
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BLOCK",
    "FILE_MODE",
    "BlockDigests",
    "atomic_save",
    "atomic_write_text",
    "block_record",
    "describe",
    "disk_error",
    "file_digest",
    "fsync_directory",
]

CHUNK = 8 * 2**20
BLOCK = 16 * 2**20
"""The bytes one block hash of a data file covers: a rank reading its share of a file saved by
another layout checks (reads) at most one block more on each side of each tensor."""


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary file beside ``path``, fsync, then ``os.replace`` onto it.

    The file is on disk before its name is: a crash at any moment leaves the old file or the
    new one, never a torn one. (The directory entry is made durable by :func:`commit`.)
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            try:
                torch.save(obj, handle)
            except RuntimeError as err:  # torch's zip writer reports a full disk this way
                failure = disk_error(path, str(err))
                if failure is None:
                    raise  # not the disk: e.g. an object that cannot be pickled
                raise failure from err
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, FILE_MODE)  # mkstemp makes 0600; every file of a run gets one mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def disk_error(path: Path, message: str) -> OSError | None:
    """The OSError naming ``path`` that torch's writer meant, or None if it was not the disk."""
    if shutil.disk_usage(path.parent).free < 2**20:
        code = errno.ENOSPC
    elif "inline_container" in message or "write" in message.lower():
        code = errno.EIO
    else:
        return None
    return OSError(code, os.strerror(code), str(path))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()
"""The mode ``open()`` gives a new file here (0644 under the usual umask)."""


def atomic_write_text(text: str, path: Path) -> None:
    """``text`` to a temporary file beside ``path``, fsync, then ``os.replace`` onto it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_directory(folder: str | os.PathLike[str]) -> None:
    """Makes the names created in ``folder`` durable (where the platform allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> str:
    """The sha256 of ``path``'s bytes (``sha256sum`` prints the same), read in 8 MiB chunks.

    sha256 rather than blake2b: with the CPU's SHA instructions it hashes about 1.6 GiB/s
    here, twice blake2b, and anyone can check a file by hand.
    """
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": hash}}`` of the files ``names`` in ``folder``."""
    return {
        name: {"bytes": (folder / name).stat().st_size, "sha256": file_digest(folder / name)}
        for name in names
    }


class BlockDigests:
    """The sha256 of each :data:`BLOCK` bytes of a stream fed in pieces of any size (the last
    block may be shorter). ``split -b 16M --filter=sha256sum FILE`` prints the same.

    >>> digests = BlockDigests()
    >>> digests.update(b"ab"); digests.update(b"c")
    >>> digests.record() == {"bytes": 3, "blocks": [hashlib.sha256(b"abc").hexdigest()]}
    True
    """

    def __init__(self) -> None:
        self.count, self._filled = 0, 0
        self._done: list[str] = []
        self._block = hashlib.sha256()

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, BLOCK - self._filled)
            self._block.update(view[:take])
            self._filled += take
            self.count += take
            view = view[take:]
            if self._filled == BLOCK:
                self._done.append(self._block.hexdigest())
                self._block, self._filled = hashlib.sha256(), 0

    def record(self) -> dict[str, Any]:
        """``{"bytes": count, "blocks": [sha256 of each block]}``."""
        tail = [self._block.hexdigest()] if self._filled else []
        return {"bytes": self.count, "blocks": self._done + tail}


def block_record(path: Path) -> dict[str, Any]:
    """:class:`BlockDigests`'s record of ``path``'s bytes (a data file read back)."""
    digests = BlockDigests()
    with path.open("rb") as handle:
        while chunk := handle.read(BLOCK):
            digests.update(chunk)
    return digests.record()
