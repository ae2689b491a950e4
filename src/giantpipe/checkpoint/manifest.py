"""The commit record: the manifest that names one save and holds the size and hashes of every
file (and of itself), read back checked, and the files checked against it: whole, or a data
file only in the blocks a read touches.

Example::

    manifest = read_manifest("ckpt")                 # CheckpointDamaged if it was changed
    verify(Path("ckpt"), manifest, committed_files(manifest))
    Verifier(Path("ckpt"), manifest).spans(name, [(0, 4096)])    # the first block alone
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from giantpipe.checkpoint.earlier import SHARDS_V1, SHARDS_V2
from giantpipe.checkpoint.errors import CheckpointDamaged, CheckpointError
from giantpipe.checkpoint.files import BLOCK, file_digest
from giantpipe.checkpoint.names import MANIFEST

__all__ = [
    "FORMAT",
    "Verifier",
    "committed_files",
    "read_manifest",
    "record_hash",
    "verify",
    "weight_names",
]

FORMAT = "giantpipe-shards/3"
"""The format written: one DCP save per folder, every file hashed in the manifest (a data file
per block of ``block_bytes``)."""


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
    if manifest.get("format") in (FORMAT, SHARDS_V2) or "record" in manifest:
        if manifest.get("record") != record_hash(manifest):
            raise CheckpointDamaged(path, "its content differs from its own hash")
    elif manifest.get("format") != SHARDS_V1:
        found = manifest.get("format")
        raise CheckpointError(path, f"is not a giantpipe checkpoint manifest (format {found!r})")
    return manifest


def verify(directory: Path, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """Checks the files ``names`` (relative to ``directory``) against the manifest's sizes and
    hashes, whole; :class:`CheckpointDamaged` naming the first that differs. Files of the
    earlier format (no hashes) pass."""
    check = Verifier(directory, manifest)
    for name in names:
        check.whole(name)


class Verifier:
    """Checks the files of one committed save against its manifest, each byte at most once: a
    file committed whole is hashed whole; a data file committed by blocks only in the blocks a
    read touches, so a rank reading its share of a file reads little more than its share."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory, self.manifest = directory, manifest
        self.block = int(manifest.get("block_bytes", BLOCK))
        self._entries: dict[str, dict[str, Any]] = {}
        self._blocks: dict[str, set[int]] = {}

    def whole(self, name: str) -> None:
        """Checks all of the file ``name``."""
        entry = self._entry(name)
        if entry is None:
            return
        if "blocks" in entry:
            self.spans(name, [(0, entry["bytes"])])
        elif name not in self._blocks:
            if file_digest(self.directory / name) != entry["sha256"]:
                raise CheckpointDamaged(self.directory / name, _DIFFERS)
            self._blocks[name] = set()

    def spans(self, name: str, spans: Iterable[tuple[int, int]]) -> None:
        """Checks the bytes of the file ``name`` that the ``(offset, length)`` spans cover (a
        file hashed whole: all of it)."""
        entry = self._entry(name)
        if entry is None:
            return
        if "blocks" not in entry:
            self.whole(name)
            return
        done = self._blocks.setdefault(name, set())
        wanted = {
            i
            for offset, length in spans
            for i in range(offset // self.block, (offset + length - 1) // self.block + 1)
            if length > 0
        }
        path = self.directory / name
        with path.open("rb") as handle:
            for i in sorted(wanted - done):
                handle.seek(i * self.block)
                digest = hashlib.sha256(handle.read(self.block)).hexdigest()
                if digest != entry["blocks"][i]:
                    raise CheckpointDamaged(path, _DIFFERS)
                done.add(i)

    def _entry(self, name: str) -> dict[str, Any] | None:
        """The manifest's entry of ``name``, its size checked once (None: the earlier format,
        which holds no hashes)."""
        if self.manifest.get("format") == SHARDS_V1:
            return None
        if name in self._entries:
            return self._entries[name]
        path = self.directory / name
        expected = self.manifest["files"].get(name)
        if expected is None:
            raise CheckpointDamaged(path, "not in the commit record")
        try:
            size = path.stat().st_size
        except FileNotFoundError as err:
            raise CheckpointDamaged(path, "missing") from err
        if size != expected["bytes"]:
            problem = "truncated" if size < expected["bytes"] else "longer than written"
            raise CheckpointDamaged(path, f"{problem}: {size} of {expected['bytes']} bytes")
        self._entries[name] = expected
        return expected


_DIFFERS = "content hash differs from the commit record"


def weight_names(manifest: dict[str, Any]) -> list[str]:
    """The model's tensor names a manifest lists (its shards' names)."""
    return [n for s in manifest["shards"] for n in s["names"]]


def committed_files(manifest: dict[str, Any]) -> list[str]:
    """The files (relative to the checkpoint directory) a manifest commits."""
    if manifest.get("format") == SHARDS_V1:
        names = [s["file"] for s in manifest.get("shards", [])]
        return names + list((manifest.get("extra") or {}).get("state_files", []))
    return list(manifest.get("files", {}))
