"""The commit record: the manifest that names one save and holds the size and hash of every
file (and of itself), read back checked, and the files checked against it.

Example::

    manifest = read_manifest("ckpt")                 # CheckpointDamaged if it was changed
    verify(Path("ckpt"), manifest, committed_files(manifest))
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from giantpipe.checkpoint.earlier import SHARDS_V1
from giantpipe.checkpoint.errors import CheckpointDamaged, CheckpointError
from giantpipe.checkpoint.files import file_digest
from giantpipe.checkpoint.names import MANIFEST

__all__ = [
    "FORMAT",
    "committed_files",
    "read_manifest",
    "record_hash",
    "verify",
    "weight_names",
]

FORMAT = "giantpipe-shards/2"
"""The format written: one DCP save per folder, every file hashed in the manifest."""


def record_hash(manifest: dict[str, Any]) -> str:
    """The sha256 of the manifest's content without its ``record`` field."""
    body = {k: v for k, v in manifest.items() if k != "record"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a checkpoint directory: FileNotFoundError if there is none,
    :class:`CheckpointDamaged` if it was changed after it was written, CheckpointError if it is
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
    elif manifest.get("format") != SHARDS_V1:
        found = manifest.get("format")
        raise CheckpointError(path, f"is not a giantpipe checkpoint manifest (format {found!r})")
    return manifest


def verify(directory: Path, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """Checks the files ``names`` (relative to ``directory``) against the manifest's sizes and
    hashes; :class:`CheckpointDamaged` naming the first that differs. Files of the earlier
    format (no hashes) pass."""
    if manifest.get("format") == SHARDS_V1:
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


def committed_files(manifest: dict[str, Any]) -> list[str]:
    """The files (relative to the checkpoint directory) a manifest commits."""
    if manifest.get("format") == SHARDS_V1:
        names = [s["file"] for s in manifest.get("shards", [])]
        return names + list((manifest.get("extra") or {}).get("state_files", []))
    return list(manifest.get("files", {}))
