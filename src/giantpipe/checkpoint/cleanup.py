"""What earlier or interrupted saves left in a checkpoint directory, and removing it: only what
bears giantpipe's own names (:mod:`giantpipe.checkpoint.names`) is ever removed.

Example::

    for path in stale(Path("outputs/run/last")):     # folders its manifest no longer names
        remove(path)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from giantpipe.checkpoint.earlier import SHARDS_V1_FILE
from giantpipe.checkpoint.manifest import committed_files, read_manifest
from giantpipe.checkpoint.names import IN_FOLDER, MANIFEST, MANIFEST_TMP, SAVE_FOLDER

__all__ = ["interrupted", "remove", "stale"]


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
        elif entry.is_file() and (SHARDS_V1_FILE.fullmatch(name) or MANIFEST_TMP.fullmatch(name)):
            found.append(entry)
    return found


def interrupted(directory: Path) -> list[Path]:
    """What killed saves left in ``directory`` that may go now: :func:`stale`'s, where a
    manifest commits another save; where there is no manifest at all, only temporary manifests
    (its save folder may be a save whose manifest was lost as well as a first save that was
    killed; the next save into ``directory`` replaces it).

    Example::

        interrupted(Path("outputs/run/step_40"))     # [.../.manifest.json.x1y2.tmp]
    """
    committed = (directory / MANIFEST).exists()
    return [p for p in stale(directory) if committed or MANIFEST_TMP.fullmatch(p.name)]


def remove(path: Path) -> None:
    """Removes a file or a folder (:func:`stale` names what may go)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _only_ours(folder: Path) -> bool:
    return all(p.is_file() and IN_FOLDER.fullmatch(p.name) for p in folder.iterdir())
