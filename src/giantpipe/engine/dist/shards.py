"""Checkpoints of a pipeline on ``torch.distributed.checkpoint`` (DCP), by un-partitioned names,
committed by a manifest that holds a content hash of every file.

::

    ckpt/
      manifest.json                  the commit point: layout, balance, names per rank, and the
                                     size and sha256 of every file below (and of itself)
      step000000100-3f9c2a/          one save, in DCP's format
        .metadata                    DCP's index: name -> file, offset, shape, dtype
        __0_0.distcp                 rank 0's tensors: "0.weight", "1.bias", ...
        __1_0.distcp                 rank 1's: "4.weight", ...

Names are those of the plain model, so a run resumes under another K, V or R (each rank reads
its names from whichever files hold them: DCP reshards by name) and :func:`consolidate`
(``python -m giantpipe.consolidate ckpt/ model.pt``) merges them into one state dict the plain
model loads. A save writes a new folder under a name unique to it, fsyncs every file, then
replaces ``manifest.json`` (``os.replace``): a process killed at any moment leaves the previous
manifest and the folder it names whole. The previous folder is removed only after the new
manifest is in place, and only what giantpipe's own names prove it wrote (:func:`stale`);
nothing at all when the previous manifest could not be read.

Loading checks before it reads: the manifest's own hash, then the size and sha256 of each
file it will open (a flipped byte or a truncated file is :class:`CheckpointDamaged`, naming the
file), and DCP's ``.metadata`` is unpickled with an allow-list of DCP's own classes; tensors
load with ``weights_only``: a checkpoint never runs code. Checkpoints of the earlier format
(``giantpipe-shards/1``: one ``step...-rankNNNNN.pt`` per rank beside the manifest) still load.

Example::

    pipe.save_checkpoint("ckpt", step=100)                 # all ranks
    state = load("ckpt", pipe.state_dict().keys())         # any layout
    consolidate("ckpt", "model.pt")                        # one process, no torch.distributed
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import re
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter

MANIFEST = "manifest.json"
FORMAT = "giantpipe-shards/2"
OLD_FORMAT = "giantpipe-shards/1"
"""One ``torch.save`` file per rank beside the manifest (read, no longer written)."""
SAVE_FOLDER = re.compile(r"step\d{9}-[0-9a-f]{6}")
"""The name of one save's folder (:func:`new_token`)."""
OLD_FILE = re.compile(r"(state-)?step\d{9}-[0-9a-f]{6}-rank\d{5}\.pt")
"""Files of the earlier format (weights, and the runner's run state)."""
IN_FOLDER = re.compile(r"\.metadata(\.tmp)?|__\d+_\d+\.distcp|state-rank\d{5}\.pt|\..+\.tmp")
"""What a save's folder holds: DCP's files, the runner's run state, temporary names."""
MANIFEST_TMP = re.compile(r"\.manifest\.json\..+\.tmp")
"""A manifest being written (:func:`atomic_write_text`)."""
CHUNK = 8 * 2**20

# DCP says so at every call without a process group; that is how one process saves and loads.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")


class CheckpointDamaged(ValueError):
    """A checkpoint file that differs from what its manifest committed (or cannot be read).

    ``str(err)`` is one line naming the file: ``ckpt/step.../__0_0.distcp is damaged (content
    hash differs from the commit record)``; ``err.path`` is the file.
    """

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path} is damaged ({problem})")
        self.path, self.problem = path, problem

    def __reduce__(self) -> tuple[Any, tuple[Path, str]]:  # crosses processes whole
        return CheckpointDamaged, (self.path, self.problem)


# -- writing files ---------------------------------------------------------------------------


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
                failure = _write_error(path, str(err))
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


def _write_error(path: Path, message: str) -> OSError | None:
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


def new_token(step: int) -> str:
    """A name unique to one save: ``step000000100-3f9c2a`` (every rank must use the same)."""
    return f"step{step:09d}-{secrets.token_hex(3)}"


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


# -- one save: DCP's files, collective ---------------------------------------------------------


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else 0


def gather(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value`` in rank order (``group`` None: this process alone)."""
    if group is None:
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def write_folder(
    folder: Path, tensors: dict[str, torch.Tensor], objects: dict[str, Any], group: Any
) -> dict[str, dict[str, Any]]:
    """Collective over ``group`` (None: one process): this rank's part of the DCP checkpoint
    of ``tensors``, then its ``objects`` (``torch.save``, e.g. its run state), every file
    fsynced. Returns the size and hash of what this rank wrote (rank 0: DCP's ``.metadata``
    too). DCP fails every rank when one fails; what follows it is this rank's alone.

    Example::

        files = write_folder(Path("ckpt/step000000100-3f9c2a"), pipe.state_dict(), {}, None)
    """
    folder.mkdir(parents=True, exist_ok=True)
    writer = _HashingWriter(folder)
    try:
        dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=group is None)
    except CheckpointException as err:  # a BaseException holding every rank's failure
        raise _cause(err, folder) from None
    for name, obj in objects.items():
        atomic_save(obj, folder / name)
    rank = _rank(group)
    data = [p.name for p in sorted(folder.glob(f"__{rank}_*.distcp"))]
    files: dict[str, dict[str, Any]] = {}
    for name in data:
        as_written = writer.fs.digest_of(folder / name)
        if as_written is not None:
            files[name] = as_written
    small = list(objects) + ([".metadata"] if rank == 0 else [])
    files.update(describe(folder, [n for n in data + small if n not in files]))
    return files


class _HashingStream:
    """A file DCP writes to, hashing every byte on its way to the file."""

    def __init__(self, raw: Any) -> None:
        self._raw, self.digest, self.count = raw, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        written: int = self._raw.write(data)
        view = memoryview(data)
        self.digest.update(view)
        self.count += view.nbytes
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
        """The size and hash of ``path`` as written, or None where the bytes that went through
        the stream are not the file's (then it is read back and hashed)."""
        hashing = self.written.get(str(path))
        size = path.stat().st_size
        if hashing is None or hashing.count != size:
            return None
        return {"bytes": size, "sha256": hashing.digest.hexdigest()}


class _HashingWriter(FileSystemWriter):
    """DCP's file writer (fsync on, one file per rank, never over an earlier save), hashing."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, sync_files=True, thread_count=1, overwrite=False)
        self.fs: _HashingFileSystem = _HashingFileSystem()


def _cause(err: CheckpointException, folder: Path) -> BaseException:
    """The failure DCP wrapped, as this process would have raised it (a full disk: the
    OSError naming the file; a Ctrl-C: KeyboardInterrupt)."""
    failures = [pair[0] for pair in err.failures.values()]
    for failure in failures:
        if isinstance(failure, KeyboardInterrupt | OSError):
            return failure
    first = failures[0] if failures else RuntimeError(str(err))
    return _write_error(folder / "__0_0.distcp", str(first)) or RuntimeError(
        f"{folder}: saving failed ({type(first).__name__}: {first})"
    )


def _agreed(value: Any, failure: Exception | None, group: Any) -> list[Any]:
    """Every rank's ``value``, or the first rank's failure raised on every rank (so that no
    rank waits in a collective for one that gave up)."""
    portable: Exception | None = failure
    if failure is not None and not isinstance(failure, OSError):  # as text that surely pickles
        portable = RuntimeError(f"rank {_rank(group)}: {type(failure).__name__}: {failure}")
    values = gather((value, portable), group)
    failures = [f for _, f in values if f is not None]
    if failure is not None:
        raise failure
    if failures:
        raise failures[0]
    return [v for v, _ in values]


def save_collective(
    directory: Path,
    token: str,
    tensors: dict[str, torch.Tensor],
    objects: dict[str, Any],
    entry: dict[str, Any] | None,
    commit_as: tuple[dict[str, Any], dict[str, Any]] | None,
    group: Any,
) -> None:
    """One save, collective over ``group``: every rank writes into ``directory/token``, rank 0
    commits it with ``commit_as`` (meta, extra: rank 0's count) and every file's hash.

    ``entry``: this rank's manifest entry (rank, stages, names of its weights), or None for a
    rank whose weights another writes (a replica). A failure on any rank fails every rank, and
    the new folder goes; the previous commit stays.

    Example::

        save_collective(Path("ckpt"), new_token(100), pipe.state_dict(), {}, entry,
                        (layout_meta(pipe, 100), {}), group)
    """
    folder, rank = directory / token, _rank(group)
    try:
        files, failure = None, None
        try:
            files = write_folder(folder, tensors, objects, group)
        except Exception as err:  # noqa: BLE001 - shared with the other ranks, then raised
            failure = err
        everything = _agreed((entry, files), failure, group)
        failure = None
        if rank == 0:
            try:
                if commit_as is None:
                    raise ValueError("rank 0 commits the save: commit_as is required there")
                entries = [e for e, _ in everything if e is not None]
                named = {f"{token}/{n}": d for _, fs in everything for n, d in fs.items()}
                commit(directory, token, named, entries, *commit_as)
            except Exception as err:  # noqa: BLE001 - shared with the other ranks, then raised
                failure = err
        _agreed(None, failure, group)
    except BaseException:
        if rank == 0 and _names(directory) != token:
            shutil.rmtree(folder, ignore_errors=True)  # made by this save, never committed
        raise


def _names(directory: Path) -> str | None:
    """The save folder ``directory``'s manifest commits (None if none can be read)."""
    try:
        return str(read_manifest(directory).get("folder"))
    except (OSError, ValueError):
        return None


# -- the commit record -------------------------------------------------------------------------


def record_hash(manifest: dict[str, Any]) -> str:
    """The sha256 of the manifest's content without its ``record`` field."""
    body = {k: v for k, v in manifest.items() if k != "record"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def commit(
    directory: Path,
    token: str,
    files: dict[str, dict[str, Any]],
    entries: list[dict[str, Any]],
    meta: dict[str, Any],
    extra: dict[str, Any],
) -> None:
    """Writes the manifest naming ``directory/token`` and every file's hash (the commit point:
    every file is on disk before it), then removes what earlier saves left (:func:`stale`).

    ``meta``: step, balance, schedule, chunks, workers, replicas, placement; ``extra``:
    anything JSON-safe the caller keeps beside them.
    """
    readable = not (directory / MANIFEST).exists() or _names(directory) is not None
    fsync_directory(directory / token)  # the files' names, before the manifest naming them
    fsync_directory(directory)
    manifest = {"format": FORMAT, **meta, "folder": token, "shards": entries, "files": files}
    manifest.update(num_layers=sum(meta["balance"]), extra=extra)
    manifest["record"] = record_hash(manifest)
    atomic_write_text(json.dumps(manifest, indent=1), directory / MANIFEST)
    fsync_directory(directory)
    if readable:  # an unreadable record named files nobody can tell apart: leave them all
        for path in stale(directory):
            _remove(path)


def layout_meta(pipe: Any, step: int) -> dict[str, Any]:
    """What a manifest records of ``pipe``'s layout (K, R, balance, schedule, M)."""
    return {
        "step": step,
        "balance": list(pipe.balance),
        "schedule": pipe.schedule,
        "chunks": pipe.chunks,
        "workers": pipe.layout.workers,
        "replicas": pipe.layout.replicas,
        "placement": list(pipe.layout.placement),
    }


def save(
    pipe: Any,
    directory: str | os.PathLike[str],
    step: int = 0,
    extra: dict[str, Any] | None = None,
    group: Any = None,
) -> None:
    """Collective: replica 0's ranks write their weights, rank 0 commits the manifest.

    ``pipe`` is a :class:`~giantpipe.engine.dist.pipe.DistributedPipe` (its layout, balance
    and local state dict are used). ``extra`` (JSON-safe) is stored in the manifest. DCP's
    collectives, the gather of the hashes and the barrier run on ``group``, a host (gloo)
    group of every rank: by default the pipe's ``groups.control``, which a failure tears down,
    so that no rank is left waiting. (Not the world: under NCCL its objects would travel
    through a GPU, and an NCCL-only world takes no CPU tensor at all.)
    """
    layout = pipe.layout
    group = pipe.groups.control if group is None else group
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    token = [new_token(step)]
    dist.broadcast_object_list(token, src=0, group=group)  # one name for this save everywhere
    tensors, entry = {}, None
    if layout.replica == 0:
        tensors = {k: v.detach() for k, v in pipe.state_dict().items()}
        entry = {"rank": layout.rank, "stages": list(layout.local_stages), "names": list(tensors)}
    commit_as = (layout_meta(pipe, step), extra or {}) if layout.rank == 0 else None
    save_collective(folder, token[0], tensors, {}, entry, commit_as, group)


# -- what may be removed -----------------------------------------------------------------------


def stale(directory: Path) -> list[Path]:
    """What earlier or interrupted saves left in ``directory`` that its manifest does not name,
    under giantpipe's own names only: save folders holding nothing but DCP's and giantpipe's
    files, files of the earlier format, manifests being written. Nothing when the manifest
    exists but cannot be read (it may name any of them).

    Example::

        stale(Path("outputs/run/last"))     # [.../last/step000000090-1c2b3a]
    """
    path = directory / MANIFEST
    keep: set[str] = set()
    if path.exists():
        try:
            manifest = read_manifest(directory)
        except (OSError, ValueError):
            return []
        keep = {name.split("/", 1)[0] for name in committed_files(manifest)}
    found = []
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if name in keep:
            continue
        if entry.is_dir() and SAVE_FOLDER.fullmatch(name) and _only_ours(entry):
            found.append(entry)
        elif entry.is_file() and (OLD_FILE.fullmatch(name) or MANIFEST_TMP.fullmatch(name)):
            found.append(entry)
    return found


def _only_ours(folder: Path) -> bool:
    return all(p.is_file() and IN_FOLDER.fullmatch(p.name) for p in folder.iterdir())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def committed_files(manifest: dict[str, Any]) -> list[str]:
    """The files (relative to the checkpoint directory) a manifest commits."""
    if manifest.get("format") == OLD_FORMAT:
        names = [s["file"] for s in manifest.get("shards", [])]
        return names + list((manifest.get("extra") or {}).get("state_files", []))
    return list(manifest.get("files", {}))


# -- reading -----------------------------------------------------------------------------------


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a checkpoint directory: FileNotFoundError if there is none,
    :class:`CheckpointDamaged` if it was changed after it was written, ValueError if it is
    no giantpipe manifest."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as err:
        raise CheckpointDamaged(path, f"not valid JSON: {err}") from err
    if not isinstance(manifest, dict):
        raise CheckpointDamaged(path, "not a JSON object")
    if manifest.get("format") == FORMAT or "record" in manifest:
        if manifest.get("record") != record_hash(manifest):
            raise CheckpointDamaged(path, "its content differs from its own hash")
    elif manifest.get("format") != OLD_FORMAT:
        raise ValueError(f"{path} is not a giantpipe shard manifest ({manifest.get('format')!r})")
    return manifest


def verify(directory: Path, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """Checks the files ``names`` (relative to ``directory``) against the manifest's sizes and
    hashes; :class:`CheckpointDamaged` naming the first that differs. Files of the earlier
    format (no hashes) pass."""
    if manifest.get("format") == OLD_FORMAT:
        return
    files = manifest["files"]
    for name in names:
        path = directory / name
        if name not in files:
            raise CheckpointDamaged(path, "not in the commit record")
        expected = files[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError as err:
            raise CheckpointDamaged(path, "missing") from err
        if size != expected["bytes"]:
            problem = "truncated" if size < expected["bytes"] else "longer than written"
            raise CheckpointDamaged(path, f"{problem}: {size} of {expected['bytes']} bytes")
        if file_digest(path) != expected["sha256"]:
            raise CheckpointDamaged(path, "content hash differs from the commit record")


def weight_names(manifest: dict[str, Any]) -> list[str]:
    """The model's tensor names a manifest lists (its shards' names)."""
    return [n for s in manifest["shards"] for n in s["names"]]


def tensor_names(directory: str | os.PathLike[str]) -> list[str]:
    """Every tensor name a checkpoint holds: the weights, and (runner checkpoints) the
    optimizer's ``optimizer/NAME/KEY`` and the EMA's ``ema/NAME``."""
    folder = Path(directory)
    manifest = read_manifest(folder)
    if manifest["format"] == OLD_FORMAT:
        return weight_names(manifest)
    meta = read_metadata(folder, manifest)
    return [k for k, v in meta.state_dict_metadata.items() if _is_tensor(v)]


def load(
    directory: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The tensors called ``names`` (default: the model's weights), from whichever files hold
    them; only those files are checked and read, so a rank of a new layout reads just what it
    needs. KeyError naming what is missing; :class:`CheckpointDamaged` naming a bad file.
    """
    folder = Path(directory)
    manifest = read_manifest(folder)
    wanted = weight_names(manifest) if names is None else list(names)
    if manifest["format"] == OLD_FORMAT:
        return _load_old(folder, manifest, wanted, device)
    meta = read_metadata(folder, manifest)
    held = {
        k: v
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, dcp_metadata.TensorStorageMetadata)
    }
    missing = [n for n in wanted if n not in held]
    if missing:
        raise KeyError(f"{folder} holds no shard with {missing[:5]} ({len(missing)} missing)")
    want = set(wanted)
    files = sorted({info.relative_path for i, info in meta.storage_data.items() if i.fqn in want})
    verify(folder, manifest, [f"{manifest['folder']}/{f}" for f in files])
    state = {n: torch.empty(held[n].size, dtype=held[n].properties.dtype) for n in wanted}
    reader = _Reader(folder / manifest["folder"], meta)
    dcp.load(state, storage_reader=reader, planner=_TensorsOnly(), no_dist=True)
    return {n: t.to(device) for n, t in state.items()}


def _load_old(
    folder: Path, manifest: dict[str, Any], wanted: list[str], device: torch.device | str
) -> dict[str, torch.Tensor]:
    where = {n: s["file"] for s in manifest["shards"] for n in s["names"]}
    missing = [n for n in wanted if n not in where]
    if missing:
        raise KeyError(f"{folder} holds no shard with {missing[:5]} ({len(missing)} missing)")
    state: dict[str, torch.Tensor] = {}
    for file in sorted({where[n] for n in wanted}):
        try:
            shard = torch.load(folder / file, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as err:
            raise CheckpointDamaged(folder / file, f"torch cannot read it: {err}") from err
        for n in wanted:
            if where[n] == file:
                if n not in shard:
                    raise CheckpointDamaged(folder / file, f"{n} is not in it")
                state[n] = shard[n].to(device).clone()
    return state


def _is_tensor(entry: Any) -> bool:
    return isinstance(entry, dcp_metadata.TensorStorageMetadata)


class _Reader(FileSystemReader):
    """DCP's file reader, handed the metadata :func:`read_metadata` checked and unpickled."""

    def __init__(self, path: Path, meta: dcp_metadata.Metadata) -> None:
        super().__init__(path)
        self._checked = meta

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return self._checked


class _TensorsOnly(DefaultLoadPlanner):
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


# -- one file for the plain model --------------------------------------------------------------


def merged(directory: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every weight, in the plain model's layer order, and the manifest."""
    manifest = read_manifest(directory)
    state = load(directory)
    position = {name: i for i, name in enumerate(state)}
    ordered = dict(sorted(state.items(), key=lambda kv: (_layer(kv[0]), position[kv[0]])))
    return ordered, manifest


def consolidate(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Merges every weight into one state dict at ``out`` (atomic); returns a short summary."""
    ordered, manifest = merged(directory)
    atomic_save(ordered, out)
    return summary(ordered, manifest)


def summary(state: dict[str, torch.Tensor], manifest: dict[str, Any]) -> dict[str, Any]:
    """Tensors, bytes, shards and step of a merged checkpoint (what consolidate prints)."""
    return {
        "tensors": len(state),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "shards": len(manifest["shards"]),
        "step": manifest["step"],
    }


def _layer(name: str) -> int:
    """The plain model's layer index of a parameter name ("12.fc.weight" -> 12)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1
