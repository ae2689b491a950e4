"""Tensors of a checkpoint directory by name: only the files a rank needs are checked and read,
and an FSDP2 shard only its own part; DCP reshards by name, so any layout reads any save.

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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from giantpipe.checkpoint.earlier import SHARDS_V1, shard_files
from giantpipe.checkpoint.errors import CheckpointError, MissingTensors
from giantpipe.checkpoint.manifest import Verifier, read_manifest, weight_names
from giantpipe.checkpoint.sources import TensorLayout, TensorSource
from giantpipe.checkpoint.storage import CheckedReader, TensorsOnly, read_metadata

__all__ = ["DcpTensors", "load", "open_tensors", "tensor_names"]


class DcpTensors:
    """The tensors of a committed DCP save, read by name: only the asked tensors' bytes are
    read, each checked against the manifest first (the blocks it lies in, once)."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.path, self.manifest = directory, manifest
        self.meta = read_metadata(directory, manifest)
        self.verifier = Verifier(directory, manifest)
        self.held = {
            k: v
            for k, v in self.meta.state_dict_metadata.items()
            if isinstance(v, dcp_metadata.TensorStorageMetadata)
        }

    def names(self) -> list[str]:
        return list(self.held)

    def layout(self, name: str) -> TensorLayout:
        if name not in self.held:
            raise MissingTensors(self.path, [name])
        saved = self.held[name]
        return TensorLayout(saved.properties.dtype, tuple(saved.size))

    def read(
        self, names: Iterable[str], like: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """``like``: where a name's entry is a DTensor of the saved shape (an FSDP2 parameter's
        shard, an optimizer state beside it), that name comes back as such a DTensor, this
        rank's part read alone, whatever the sharding it was saved with; any other name comes
        back whole, in host memory."""
        wanted = list(names)
        missing = [n for n in wanted if n not in self.held]
        if missing:
            raise MissingTensors(self.path, missing)
        state = {n: _destination(self.held[n], (like or {}).get(n)) for n in wanted}
        reader = CheckedReader(self.path / self.manifest["folder"], self.meta, self._check)
        try:
            dcp.load(state, storage_reader=reader, planner=TensorsOnly(), no_dist=True)
        except CheckpointException as err:  # DCP wraps what the reader raised: say that
            raise _cause(err) from None
        return state

    def _check(self, name: str, spans: list[tuple[int, int]]) -> None:
        self.verifier.spans(f"{self.manifest['folder']}/{name}", spans)


def _cause(err: CheckpointException) -> BaseException:
    """The failure DCP wrapped: a damaged file or a refused object as such, naming the file."""
    failures = [pair[0] for pair in err.failures.values()]
    found = [f for f in failures if isinstance(f, CheckpointError | pickle.UnpicklingError)]
    return found[0] if found else err


def _destination(saved: Any, like: torch.Tensor | None) -> torch.Tensor:
    """Where DCP reads a tensor into: ``like``'s sharding when it is a DTensor of the saved
    shape (only this rank's shard is read, on its device), else a whole tensor on the host."""
    dtype = saved.properties.dtype
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(saved.size):
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(saved.size, dtype=dtype)


def open_tensors(directory: str | os.PathLike[str]) -> TensorSource:
    """The tensors of a checkpoint directory, of today's format or the earlier one."""
    return _source(Path(directory), read_manifest(directory))


def _source(folder: Path, manifest: dict[str, Any]) -> TensorSource:
    if manifest["format"] == SHARDS_V1:
        return shard_files(folder, manifest)
    return DcpTensors(folder, manifest)


def tensor_names(directory: str | os.PathLike[str]) -> list[str]:
    """Every tensor name a checkpoint holds: the weights, and (runner checkpoints) the
    optimizer's ``optimizer/NAME/KEY`` and the EMA's ``ema/NAME``."""
    return open_tensors(directory).names()


def load(
    directory: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    device: torch.device | str = "cpu",
    like: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors called ``names`` (default: the model's weights), from whichever files hold
    them; only those files are checked and read, so a rank of a new layout reads just what it
    needs. :class:`MissingTensors` naming what is missing, :class:`CheckpointDamaged` naming a
    bad file. ``like``: see :meth:`DcpTensors.read`."""
    manifest = read_manifest(directory)
    wanted = weight_names(manifest) if names is None else list(names)
    state = _source(Path(directory), manifest).read(wanted, like)
    return {n: t if isinstance(t, DTensor) else t.to(device) for n, t in state.items()}
