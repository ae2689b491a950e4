"""Reading a save: only the files a rank needs, each checked against the commit record first;
DCP's ``.metadata`` unpickled with an allow-list of DCP's classes, tensors with ``weights_only``
(a checkpoint never runs code); the earlier format (one ``torch.save`` file per rank) too.

Example::

    state = load("ckpt", pipe.state_dict().keys())   # any layout: DCP reshards by name
    tensor_names("ckpt")                             # weights, optimizer/..., ema/...
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.tensor import DTensor

from giantpipe.engine.distributed.shards.record import (
    OLD_FORMAT,
    CheckpointDamaged,
    read_manifest,
    verify,
    weight_names,
)

__all__ = ["load", "read_metadata", "tensor_names"]


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
    like: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors called ``names`` (default: the model's weights), from whichever files hold
    them; only those files are checked and read, so a rank of a new layout reads just what it
    needs. KeyError naming what is missing; :class:`CheckpointDamaged` naming a bad file.

    ``like``: where a name's entry is a DTensor of the saved shape (an FSDP2 parameter's shard,
    an optimizer state beside it), that name comes back as such a DTensor, this rank's part
    read alone, whatever the sharding it was saved with; any other name comes back whole.
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
    state = {n: _destination(held[n], (like or {}).get(n)) for n in wanted}
    reader = _Reader(folder / manifest["folder"], meta)
    dcp.load(state, storage_reader=reader, planner=_TensorsOnly(), no_dist=True)
    return {n: t if isinstance(t, DTensor) else t.to(device) for n, t in state.items()}


def _destination(saved: Any, like: torch.Tensor | None) -> torch.Tensor:
    """Where DCP reads a tensor into: ``like``'s sharding when it is a DTensor of the saved
    shape (only this rank's shard is read, on its device), else a whole tensor on the host."""
    dtype = saved.properties.dtype
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(saved.size):
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(saved.size, dtype=dtype)


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
