"""One save, collective: every rank writes its part of the DCP checkpoint (hashed as written),
then rank 0 commits it with the manifest and removes what earlier saves left.

Example::

    save(pipe, "ckpt", step=100)                     # all ranks of a DistributedPipe
    save_collective(Path("ckpt"), new_token(100), tensors, {}, entry, commit_as, group)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from giantpipe.checkpoint.cleanup import remove, stale
from giantpipe.checkpoint.files import (
    BLOCK,
    atomic_save,
    atomic_write_text,
    block_record,
    describe,
    disk_error,
    fsync_directory,
)
from giantpipe.checkpoint.manifest import FORMAT, read_manifest, record_hash
from giantpipe.checkpoint.names import MANIFEST, new_token
from giantpipe.checkpoint.storage import HashingWriter

__all__ = [
    "commit",
    "gather",
    "layout_meta",
    "replica_share",
    "save",
    "save_collective",
    "write_folder",
]


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
    fsynced. Returns the size and hashes of what this rank wrote (its data files per block,
    hashed as written; rank 0: DCP's ``.metadata`` too). DCP fails every rank when one fails;
    what follows it is this rank's alone.

    Example::

        files = write_folder(Path("ckpt/step000000100-3f9c2a"), pipe.state_dict(), {}, None)
    """
    folder.mkdir(parents=True, exist_ok=True)
    writer = HashingWriter(folder)
    try:
        dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=group is None)
    except CheckpointException as err:  # a BaseException holding every rank's failure
        raise _cause(err, folder) from None
    for name, obj in objects.items():
        atomic_save(obj, folder / name)
    rank = _rank(group)
    data = [p.name for p in sorted(folder.glob(f"__{rank}_*.distcp"))]
    files = {name: writer.digest_of(folder / name) or block_record(folder / name) for name in data}
    small = list(objects) + ([".metadata"] if rank == 0 else [])
    files.update(describe(folder, small))
    return files


def _cause(err: CheckpointException, folder: Path) -> BaseException:
    """The failure DCP wrapped, as this process would have raised it (a full disk: the
    OSError naming the file; a Ctrl-C: KeyboardInterrupt)."""
    failures = [pair[0] for pair in err.failures.values()]
    for failure in failures:
        if isinstance(failure, KeyboardInterrupt | OSError):
            return failure
    first = failures[0] if failures else RuntimeError(str(err))
    return disk_error(folder / "__0_0.distcp", str(first)) or RuntimeError(
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
    manifest.update(num_layers=sum(meta["balance"]), block_bytes=BLOCK, extra=extra)
    manifest["record"] = record_hash(manifest)
    atomic_write_text(json.dumps(manifest, indent=1), directory / MANIFEST)
    fsync_directory(directory)
    if readable:  # an unreadable record named files nobody can tell apart: leave them all
        for path in stale(directory):
            remove(path)


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


def replica_share(tensors: dict[str, torch.Tensor], replica: int) -> dict[str, torch.Tensor]:
    """What one replica's rank writes of its ``tensors``: replica 0 all of them; any other
    only its FSDP2 shards (DTensors), its plain tensors (buffers such as BatchNorm's running
    statistics, which replicas may hold apart) being replica 0's to write.

    >>> list(replica_share({"w": torch.ones(1)}, 0)), list(replica_share({"w": torch.ones(1)}, 1))
    (['w'], [])
    """
    if replica == 0:
        return tensors
    return {k: v for k, v in tensors.items() if isinstance(v, DTensor)}


def save(
    pipe: Any,
    directory: str | os.PathLike[str],
    step: int = 0,
    extra: dict[str, Any] | None = None,
    group: Any = None,
) -> None:
    """Collective: replica 0's ranks write their weights (with FSDP2, every rank writes its
    shards, none gathered; DCP keeps one copy of a replicated DTensor), rank 0 commits the
    manifest.

    ``pipe`` is a :class:`~giantpipe.engine.distributed.pipe.DistributedPipe` (its layout, balance
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
    tensors = replica_share({k: v.detach() for k, v in pipe.state_dict().items()}, layout.replica)
    entry = None
    if layout.replica == 0:  # the names, once: every replica holds the same ones
        entry = {"rank": layout.rank, "stages": list(layout.local_stages), "names": list(tensors)}
    commit_as = (layout_meta(pipe, step), extra or {}) if layout.rank == 0 else None
    save_collective(folder, token[0], tensors, {}, entry, commit_as, group)
