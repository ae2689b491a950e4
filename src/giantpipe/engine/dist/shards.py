"""Checkpoints of a distributed pipeline: a shard per rank, by un-partitioned names, a manifest.

::

    ckpt/
      manifest.json                       the commit point: layout, balance, names per shard
      step000100-3f9c2a-rank00000.pt      rank 0's state dict: "0.weight", "1.bias", ...
      step000100-3f9c2a-rank00001.pt      rank 1's: "4.weight", ...

Names are those of the plain model, so a run resumes under another K, V or R (each rank loads
its names from whichever shards hold them) and :func:`consolidate` (``python -m
giantpipe.consolidate ckpt/ model.pt``) merges the shards into one state dict the plain model
loads. Every file is written to a temporary name and moved into place (``os.replace``); shard
names carry a token unique to the save, and the manifest, replaced last, is what makes a save
count. Every shard is fsynced before the manifest that commits it. A rank killed half-way through
a save leaves the previous manifest and its shards intact; they are removed only after the new
manifest is in place. The pieces (:func:`write_shard`, :func:`commit`) also serve the runner,
whose checkpoints are in this format whatever the executor (a local run writes one shard).

Example::

    pipe.save_checkpoint("ckpt", step=100)                 # all ranks
    state = load("ckpt", pipe.state_dict().keys())         # any layout
    consolidate("ckpt", "model.pt")                        # one process, no torch.distributed
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
FORMAT = "giantpipe-shards/1"


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


def _atomic_write_text(text: str, path: Path) -> None:
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


def write_shard(
    state: dict[str, torch.Tensor], folder: Path, token: str, rank: int, stages: list[int]
) -> dict[str, Any]:
    """Writes one rank's tensors (fsynced) and returns its manifest entry.

    Example::

        entry = write_shard(pipe.state_dict(), Path("ckpt"), new_token(100), 0, [0])
    """
    name = f"{token}-rank{rank:05d}.pt"
    cpu = {k: v.detach().cpu() for k, v in state.items()}
    atomic_save(cpu, folder / name)
    return {"file": name, "rank": rank, "stages": list(stages), "names": list(cpu)}


def commit(
    folder: Path, entries: list[dict[str, Any]], meta: dict[str, Any], extra: dict[str, Any]
) -> None:
    """Writes the manifest (the commit point: every shard is on disk before it), then removes
    the shards of earlier saves. ``meta``: step, balance, schedule, chunks, workers, replicas,
    placement; ``extra``: anything JSON-safe the caller keeps beside them."""
    fsync_directory(folder)  # the shards' names, before the manifest that points at them
    manifest = {"format": FORMAT, **meta, "shards": entries, "extra": extra}
    manifest["num_layers"] = sum(meta["balance"])
    _atomic_write_text(json.dumps(manifest, indent=1), folder / MANIFEST)
    fsync_directory(folder)
    _remove_stale(folder, {e["file"] for e in entries})


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
    """Collective: replica 0's ranks write their shards, rank 0 commits the manifest.

    ``pipe`` is a :class:`~giantpipe.engine.dist.pipe.DistributedPipe` (its layout, balance
    and local state dict are used). ``extra`` (JSON-safe) is stored in the manifest. The
    object collectives and the barrier run on ``group``, a host (gloo) group of every rank:
    by default the pipe's ``groups.control``, which a failure tears down, so that no rank is
    left waiting. (Not the world: under NCCL its objects would travel through a GPU, and an
    NCCL-only world takes no CPU tensor at all.)
    """
    layout = pipe.layout
    group = pipe.groups.control if group is None else group
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    token = [new_token(step)]
    dist.broadcast_object_list(token, src=0, group=group)  # one name for this save everywhere
    entry = None
    if layout.replica == 0:
        entry = write_shard(pipe.state_dict(), folder, token[0], layout.rank, layout.local_stages)
    entries: list[Any] = [None] * layout.world_size
    dist.all_gather_object(entries, entry, group=group)
    if layout.rank == 0:
        commit(folder, [e for e in entries if e is not None], layout_meta(pipe, step), extra or {})
    dist.barrier(group=group)


def _remove_stale(folder: Path, keep: set[str]) -> None:
    for path in folder.glob("step*-rank*.pt"):
        if path.name not in keep:
            path.unlink(missing_ok=True)


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a shard directory (raises FileNotFoundError / ValueError if unusable)."""
    path = Path(directory) / MANIFEST
    manifest: dict[str, Any] = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a giantpipe shard manifest ({manifest.get('format')!r})")
    return manifest


def load(
    directory: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The tensors called ``names`` (default: all), from whichever shards hold them.

    Only the shards that hold a wanted name are opened (memory-mapped), so a rank of a new
    layout reads just what it needs.
    """
    folder = Path(directory)
    manifest = read_manifest(folder)
    where = {n: s["file"] for s in manifest["shards"] for n in s["names"]}
    wanted = list(where) if names is None else list(names)
    missing = [n for n in wanted if n not in where]
    if missing:
        raise KeyError(f"{folder} holds no shard with {missing[:5]} ({len(missing)} missing)")
    state: dict[str, torch.Tensor] = {}
    for file in sorted({where[n] for n in wanted}):
        shard = torch.load(folder / file, map_location="cpu", weights_only=True, mmap=True)
        for n in wanted:
            if where[n] == file:
                state[n] = shard[n].to(device).clone()
    return state


def consolidate(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Merges every shard into one state dict at ``out`` (atomic); returns a short summary."""
    state = load(directory)
    manifest = read_manifest(directory)
    position = {name: i for i, name in enumerate(state)}
    ordered = dict(sorted(state.items(), key=lambda kv: (_layer(kv[0]), position[kv[0]])))
    atomic_save(ordered, out)
    return {
        "tensors": len(ordered),
        "bytes": sum(t.numel() * t.element_size() for t in ordered.values()),
        "shards": len(manifest["shards"]),
        "step": manifest["step"],
    }


def _layer(name: str) -> int:
    """The plain model's layer index of a parameter name ("12.fc.weight" -> 12)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1
