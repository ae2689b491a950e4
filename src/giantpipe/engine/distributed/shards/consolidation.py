"""One file for the plain model: every weight of a checkpoint merged into one state dict, in
the plain model's layer order (``python -m giantpipe.consolidate ckpt/ model.pt``).

Example::

    consolidate("ckpt", "model.pt")    # {"tensors": ..., "bytes": ..., "shards": ..., "step": 100}
"""

from __future__ import annotations

import os
from typing import Any

import torch

from giantpipe.engine.distributed.shards.files import atomic_save
from giantpipe.engine.distributed.shards.reading import load
from giantpipe.engine.distributed.shards.record import read_manifest

__all__ = ["consolidate", "merged", "summary"]


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
