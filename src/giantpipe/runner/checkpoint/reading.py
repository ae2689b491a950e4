"""Reading a checkpoint directory: its manifest and run entry, its run-state files checked
against the manifest's hashes, the whole checkpoint as one mapping (:func:`read_checkpoint`),
and a damaged file refused in one line that names a kept ``step_N/`` to use instead.

Example::

    read_checkpoint(run_dir / "last")["step"]               # 100
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from giantpipe.config import ConfigError
from giantpipe.engine.distributed import shards
from giantpipe.runner.checkpoint.state import EMA, RESUME, RUN_FORMAT
from giantpipe.runner.checkpoint.unpickling import safe_load


def read_state_file(directory: Path, name: str, manifest: dict[str, Any]) -> Any:
    """A run-state file of the checkpoint, checked against the manifest's hash first."""
    shards.verify(directory, manifest, [name])
    return safe_load(directory / name, RESUME, mmap=True)


def kept_beside(directory: Path) -> Path | None:
    """The newest other checkpoint of the same run (``step_N/`` beside ``directory``) whose
    manifest reads, to offer when ``directory`` is damaged."""
    here = directory.resolve()
    numbered = [p for p in here.parent.glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    for path in sorted(numbered, key=lambda p: int(p.name[5:]), reverse=True):
        if path.resolve() == here:
            continue
        try:
            shards.read_manifest(path)
        except (OSError, ValueError):
            continue
        return directory.parent / path.name
    return None


def refusal(err: shards.CheckpointDamaged, directory: Path, key: str = RESUME) -> ConfigError:
    """One line: the damaged file, and what to do (resume from a kept ``step_N/``)."""
    kept = kept_beside(directory)
    if kept is not None:
        verb = "resume" if key == RESUME else "start"
        return ConfigError(key, f"{err}; {verb} from {kept} with {key}={kept}")
    return ConfigError(
        key,
        f"{err}; nothing was removed, and no other checkpoint is kept beside it "
        "(trainer.checkpoint_every keeps step_N/ copies)",
    )


@contextlib.contextmanager
def refusing_damage(directory: Path, key: str = RESUME) -> Iterator[None]:
    """A damaged file read inside becomes :func:`refusal`'s ConfigError."""
    try:
        yield
    except shards.CheckpointDamaged as err:
        raise refusal(err, directory, key) from err


def read_run(directory: Path, key: str = RESUME) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint directory's manifest and its run entry; ConfigError naming ``key``."""
    try:
        with refusing_damage(directory, key):
            manifest = shards.read_manifest(directory)
    except (OSError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(key, f"{directory} is not a readable checkpoint ({err})") from err
    extra: dict[str, Any] = manifest.get("extra") or {}
    if extra.get("format") != RUN_FORMAT:
        raise ConfigError(
            key,
            f"{directory} holds weights without run state; start a new run from them with "
            "python -m giantpipe.consolidate DIR model.pt and trainer.init_from=model.pt",
        )
    return manifest, extra


def run_extra(directory: Path, key: str = RESUME) -> dict[str, Any]:
    """The run state's entry in a checkpoint directory's manifest; ConfigError naming ``key``."""
    return read_run(directory, key)[1]


def read_checkpoint(directory: Path, key: str = RESUME) -> dict[str, Any]:
    """A checkpoint as one mapping, to look into: ``step``, ``position``, ``model`` (every
    weight, merged), ``ema`` (merged, or None) and the manifest's ``balance`` and ``workers``.
    Every file read is checked against the manifest's hashes first; a refusal names ``key``
    (the setting that asked for the checkpoint).

    Example::

        read_checkpoint(Path("outputs/2026-12-01/10-00-00/last"))["step"]   # 120
    """
    with refusing_damage(directory, key):
        manifest, extra = read_run(directory, key)
        model = shards.load(directory)
        ema = None
        if extra["ema"] and manifest["format"] == shards.OLD_FORMAT:
            files = extra["state_files"]
            leaders = [
                read_state_file(directory, files[r], manifest) for r in extra["leader_ranks"]
            ]
            ema = {n: t for s in leaders for n, t in (s["ema"] or {}).items()}
        elif extra["ema"]:
            names = [n for n in shards.tensor_names(directory) if n.startswith(EMA)]
            ema = {n[len(EMA) :]: t for n, t in shards.load(directory, names).items()}
    return {
        "step": int(extra["step"]),
        "position": int(extra["position"]),
        "model": model,
        "ema": ema,
        "balance": manifest["balance"],
        "workers": manifest["workers"],
    }
