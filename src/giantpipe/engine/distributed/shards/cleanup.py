"""What earlier or interrupted saves left in a checkpoint directory, under giantpipe's own
names only, and may be removed.

Example::

    for path in stale(Path("outputs/run/last")):     # folders its manifest no longer names
        print(path)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from giantpipe.engine.distributed.shards.record import MANIFEST, committed_files, read_manifest

__all__ = ["IN_FOLDER", "MANIFEST_TMP", "OLD_FILE", "SAVE_FOLDER", "stale"]

SAVE_FOLDER = re.compile(r"step\d{9}-[0-9a-f]{6}")
"""The name of one save's folder (:func:`new_token`)."""
OLD_FILE = re.compile(r"(state-)?step\d{9}-[0-9a-f]{6}-rank\d{5}\.pt")
"""Files of the earlier format (weights, and the runner's run state)."""
IN_FOLDER = re.compile(r"\.metadata(\.tmp)?|__\d+_\d+\.distcp|state-rank\d{5}\.pt|\..+\.tmp")
"""What a save's folder holds: DCP's files, the runner's run state, temporary names."""
MANIFEST_TMP = re.compile(r"\.manifest\.json\..+\.tmp")
"""A manifest being written (:func:`atomic_write_text`)."""


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
