"""DCP's files as giantpipe writes and reads them: hashed block by block on their way to disk,
read back with the checked metadata and only after the bytes about to be read were checked,
pickled objects refused, and ``.metadata`` unpickled with an allow-list of DCP's own classes (a
checkpoint never runs code).

Example::

    writer = HashingWriter(Path("ckpt/step000000100-3f9c2a"))   # dcp.save(..., storage_writer=)
    meta = read_metadata(Path("ckpt"), read_manifest("ckpt"))     # checked, then unpickled
"""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from giantpipe.checkpoint.errors import CheckpointDamaged
from giantpipe.checkpoint.files import BlockDigests
from giantpipe.checkpoint.manifest import verify

__all__ = ["CheckedReader", "HashingWriter", "Spans", "TensorsOnly", "read_metadata"]

# DCP says so at every call without a process group; that is how one process saves and loads.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")


class _HashingStream:
    """A file DCP writes to, hashing every block on its way to the file."""

    def __init__(self, raw: Any) -> None:
        self._raw, self.digests = raw, BlockDigests()

    def write(self, data: Any) -> int:
        written: int = self._raw.write(data)
        self.digests.update(data)
        return written

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the file's own
        return getattr(self._raw, name)


class _HashingFileSystem(FileSystem):
    """DCP's local files, hashed as written: a checkpoint's bytes are never read back to be
    hashed (a 3 GiB save: about 1.5 s fewer; see benchmarks/checkpoint_save.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, _HashingStream] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            self.written[str(path)] = hashing
            yield hashing

    def digest_of(self, path: Path) -> dict[str, Any] | None:
        """The size and block hashes of ``path`` as written, or None where the bytes that went
        through the stream are not the file's (then it is read back and hashed)."""
        hashing = self.written.get(str(path))
        if hashing is None or hashing.digests.count != path.stat().st_size:
            return None
        return hashing.digests.record()


class HashingWriter(FileSystemWriter):
    """DCP's file writer (fsync on, one file per rank, never over an earlier save), hashing
    what it writes (:meth:`digest_of`)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, sync_files=True, thread_count=1, overwrite=False)
        self.fs: _HashingFileSystem = _HashingFileSystem()

    def digest_of(self, path: Path) -> dict[str, Any] | None:
        """``{"bytes", "blocks"}`` of ``path`` as written; None if it must be read back."""
        return self.fs.digest_of(path)


Spans = Callable[[str, list[tuple[int, int]]], None]
"""Checks ``(offset, length)`` spans of a file of the save (by its name in the save's folder)."""


class CheckedReader(FileSystemReader):
    """DCP's file reader, handed the metadata :func:`read_metadata` checked and unpickled, that
    has ``check`` look at the bytes of each file it is about to read (and nothing else)."""

    def __init__(self, path: Path, meta: dcp_metadata.Metadata, check: Spans) -> None:
        super().__init__(path)
        self._checked, self._check = meta, check

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return self._checked

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        spans: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            spans.setdefault(info.relative_path, []).append((info.offset, info.length))
        for name, found in spans.items():
            self._check(name, found)
        return super().read_data(plan, planner)


class TensorsOnly(DefaultLoadPlanner):
    """DCP's planner, refusing pickled objects (DCP would unpickle them with weights_only off;
    giantpipe saves tensors only)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise pickle.UnpicklingError(f"{read_item.dest_index.fqn} is a pickled object; refused")


def read_metadata(folder: Path, manifest: dict[str, Any]) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` of the committed save, checked against the manifest, unpickled with
    an allow-list of DCP's classes (:class:`CheckpointDamaged` if anything else is in it)."""
    name = f"{manifest['folder']}/.metadata"
    verify(folder, manifest, [name])
    with (folder / name).open("rb") as handle:
        try:
            meta = _MetadataUnpickler(handle).load()
        except pickle.UnpicklingError as err:
            raise CheckpointDamaged(folder / name, str(err)) from err
        except (EOFError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointDamaged(folder / name, f"not DCP metadata: {err}") from err
    if not isinstance(meta, dcp_metadata.Metadata):
        raise CheckpointDamaged(folder / name, "not DCP metadata")
    return meta


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` (dataclasses, sizes, dtypes, paths) and nothing else: DCP
    itself calls ``pickle.load``, which would run whatever a crafted file names."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_CLASSES.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(
                f"holds {module}.{name}, which DCP's metadata never holds; refused without "
                "running it"
            )
        return super().find_class(module, name)
