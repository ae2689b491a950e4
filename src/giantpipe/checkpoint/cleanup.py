"""What earlier or interrupted saves left in a checkpoint directory, and removing a whole
checkpoint: only what bears giantpipe's own names (:mod:`giantpipe.checkpoint.names`) is ever
removed, and a removal killed half-way leaves no checkpoint torn.

Example::

    for path in stale(Path("outputs/run/last")):     # folders its manifest no longer names
        remove(path)
    remove_checkpoint(Path("outputs/run/step_40"))   # retention: one kept copy fewer
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from giantpipe.checkpoint.earlier import SHARDS_V1_FILE
from giantpipe.checkpoint.errors import CheckpointError
from giantpipe.checkpoint.files import fsync_directory
from giantpipe.checkpoint.manifest import committed_files, read_manifest
from giantpipe.checkpoint.names import IN_FOLDER, MANIFEST, MANIFEST_TMP, REMOVING, SAVE_FOLDER

__all__ = ["interrupted", "remove", "remove_checkpoint", "set_aside", "stale"]


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


def remove_checkpoint(directory: Path) -> None:
    """Removes a whole checkpoint directory giantpipe wrote (``RUN/step_N/``), crash-safe: it
    is first renamed aside (``RUN/.step_N.removing-3f9c2a``: one atomic rename, fsynced), so a
    process killed at any moment leaves the whole checkpoint or a name nothing reads as one
    (:func:`set_aside` finds it), then deleted. CheckpointError naming what is in the way, and
    nothing removed, when ``directory`` holds anything giantpipe did not write.

    Example::

        remove_checkpoint(Path("outputs/run/step_40"))
    """
    foreign = sorted(p.name for p in directory.iterdir() if not _written(p))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise CheckpointError(
            directory, f"holds {shown}, which giantpipe did not write; nothing was removed"
        )
    aside = directory.parent / f".{directory.name}.removing-{secrets.token_hex(3)}"
    os.rename(directory, aside)
    fsync_directory(directory.parent)
    shutil.rmtree(aside)


def set_aside(parent: Path) -> list[Path]:
    """What a killed :func:`remove_checkpoint` left in ``parent`` (a run directory): checkpoint
    directories set aside, holding nothing giantpipe did not write.

    Example::

        set_aside(Path("outputs/run"))     # [.../.step_40.removing-3f9c2a]
    """
    return [
        p
        for p in sorted(parent.iterdir())
        if p.is_dir() and REMOVING.fullmatch(p.name) and all(_written(q) for q in p.iterdir())
    ]


def _written(path: Path) -> bool:
    """Whether giantpipe wrote ``path``, an entry of a checkpoint directory."""
    if path.is_dir():
        return bool(SAVE_FOLDER.fullmatch(path.name)) and _only_ours(path)
    names = (MANIFEST_TMP, SHARDS_V1_FILE)
    return path.name == MANIFEST or any(n.fullmatch(path.name) for n in names)


def _only_ours(folder: Path) -> bool:
    return all(p.is_file() and IN_FOLDER.fullmatch(p.name) for p in folder.iterdir())
