"""The run directory: where a run starts or resumes, one run at a time, nothing left half-written.

Decided before anything is written: a fresh run, a resume or ``trainer.resume=auto`` against
what the directory holds (:func:`resume_point`), a changed config refused
(:func:`check_resumed_config`), one run at a time (:class:`RunLock`), and what killed saves
left removed (:func:`clean_interrupted_saves`): docs/running.md#where-a-run-starts-or-resumes.

Example::

    checkpoint = resume_point(cfg.trainer.resume, run_dir, cfg.trainer.overwrite)
    with RunLock(run_dir) as lock:
        ...                                  # restore from checkpoint
        clean_interrupted_saves(run_dir)
        ...                                  # the run
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import yaml

from giantpipe.checkpoint.cleanup import interrupted, remove, set_aside
from giantpipe.checkpoint.earlier import ONE_FILE
from giantpipe.checkpoint.manifest import read_manifest
from giantpipe.checkpoint.names import MANIFEST, SAVE_FOLDER
from giantpipe.config import RESUME_AUTO, RESUME_CHECKED, ConfigError
from giantpipe.runner.registry import current_target

log = logging.getLogger(__name__)

LAST = "last"
"""The checkpoint directory refreshed at every evaluation and at the end."""
LOCK = ".giantpipe.lock"
RECORD = ("metrics.jsonl", "summary.json")
"""Files that say a directory holds a run's record."""
KEY = "trainer.resume"


def held_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``run_dir`` holds, if any: ``last/`` or a legacy ``last.pt``."""
    if (run_dir / LAST / MANIFEST).is_file():
        return run_dir / LAST
    if (run_dir / ONE_FILE).exists():  # the earlier one-file format
        return run_dir / ONE_FILE
    return None


def _shown(path: Path, run_dir: Path) -> str:
    name = path.relative_to(run_dir)
    return f"{name}/{MANIFEST}" if path.is_dir() else str(name)


def lost_last(run_dir: Path, resume: bool | str) -> ConfigError | None:
    """The refusal of a run directory without a committed ``last/`` that still holds the run's
    checkpoints: a ``last/`` save folder whose ``manifest.json`` is missing (lost, or the first
    save of ``last/`` was killed: the two look alike), or good ``step_N/`` copies. Starting over
    would move the record aside and rewrite them, so every mode refuses, naming the newest good
    ``step_N/`` to resume from; nothing is changed. None when there is no such checkpoint.

    Example::

        lost_last(Path("outputs/run"), "auto")
        # ConfigError: trainer.resume: outputs/run/last/manifest.json is missing (...); nothing
        # was changed: resume from outputs/run/step_40 with trainer.resume=outputs/run/step_40
    """
    last = run_dir / LAST
    orphan = last.is_dir() and any(
        p.is_dir() and SAVE_FOLDER.fullmatch(p.name) for p in last.iterdir()
    )
    kept = kept_beside(last)
    if orphan:
        problem = f"{last / MANIFEST} is missing ({last} holds a save without its commit record)"
    elif kept is None:
        return None
    elif resume is False:
        problem = f"{run_dir} already holds a run ({kept.name}/{MANIFEST}, no {LAST}/)"
    else:
        problem = f"no checkpoint at {last}, but {run_dir} keeps {kept.name}/"
    if kept is None:
        return ConfigError(
            KEY,
            f"{problem}; nothing was changed, and no step_N/ is kept beside it: move {last} "
            "aside to start over",
        )
    return ConfigError(
        KEY,
        f"{problem}; nothing was changed: resume from {kept} with {KEY}={kept}, or choose "
        "another hydra.run.dir",
    )


def resume_point(resume: bool | str, run_dir: Path, overwrite: bool = False) -> Path | None:
    """The checkpoint to resume from (a directory, or a ``.pt`` of the earlier format), or None
    for a fresh run; ConfigError when the request cannot be met. A checkpoint from elsewhere
    may not replace the run ``run_dir`` holds; one of its own kept ``step_N/`` may.

    Example::

        resume_point(True, Path("outputs/2024-05-01/10-00-00"))   # .../last
    """
    held = held_checkpoint(run_dir)
    lost = lost_last(run_dir, resume) if held is None else None
    if lost is not None and resume in (True, False, RESUME_AUTO):
        raise lost
    if resume == RESUME_AUTO:  # a record without a checkpoint: see moves_record_aside
        return held
    if resume is False:
        if held is not None:
            raise ConfigError(
                KEY,
                f"{run_dir} already holds a run ({_shown(held, run_dir)}); pass "
                "trainer.resume=true to continue it, or choose another hydra.run.dir",
            )
        record = [name for name in RECORD if (run_dir / name).exists()]
        if record and not overwrite:
            raise ConfigError(
                KEY,
                f"{run_dir} holds another run's record ({', '.join(record)}) but no checkpoint "
                "to resume; choose another hydra.run.dir, or set trainer.overwrite=true to move "
                "that record aside and start over",
            )
        return None
    if resume is True:
        if held is None:
            raise ConfigError(KEY, f"no checkpoint at {run_dir / LAST}")
        return held
    path = Path(str(resume)).expanduser()
    if path.name == MANIFEST:
        path = path.parent
    if not (path.is_file() or (path / MANIFEST).is_file()):
        raise ConfigError(KEY, f"no checkpoint at {path}")
    own = path.is_dir() and path.resolve() in checkpoint_directories(run_dir.resolve())
    if held is not None and not held.samefile(path) and not own:  # own: a kept step_N/
        raise ConfigError(
            KEY,
            f"{run_dir} holds another run's {_shown(held, run_dir)}; resume from a checkpoint "
            "into a new directory",
        )
    return path


def finished_run(resume: bool | str, run_dir: Path, max_steps: int | None) -> bool:
    """``trainer.resume=auto``: whether ``run_dir`` holds a run that completed and has nothing
    left to do (its summary says ``completed`` and either no checkpoint can continue it, a kept
    ``step_N/`` included, or it reached ``trainer.max_steps``, or stopped early). Such a run is
    skipped, unchanged.

    Example::

        finished_run("auto", Path("outputs/multirun/2026-12-01/10-00-00/0"), 300)   # True
    """
    if resume != RESUME_AUTO:
        return False
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(summary, dict) or summary.get("status") != "completed":
        return False
    steps = summary.get("steps")
    reached = max_steps is not None and isinstance(steps, int) and steps >= max_steps
    reached = reached or "stopped_early" in summary  # trainer.early_stop_patience ended it
    unheld = held_checkpoint(run_dir) is None and lost_last(run_dir, resume) is None
    return reached or unheld


def moves_record_aside(resume: bool | str, run_dir: Path, overwrite: bool) -> bool:
    """Whether a fresh start first moves another run's record aside (``replaced-N/``):
    ``trainer.overwrite=true``, or ``trainer.resume=auto`` finding the record of a run that
    never saved a checkpoint (nothing to resume; started over, nothing deleted)."""
    found = any((run_dir / name).exists() for name in RECORD)
    return overwrite or (resume == RESUME_AUTO and found)


# -- a resume continues the same run ------------------------------------------------------------


def saved_config(checkpoint: Path, step: int) -> Path | None:
    """The config the run holding ``checkpoint`` was last started with at or before ``step``:
    its ``config.yaml`` or the latest ``config.resume_S.yaml`` with ``S <= step``."""
    folder = checkpoint.parent
    found: dict[int, Path] = {}
    if (folder / "config.yaml").is_file():
        found[0] = folder / "config.yaml"
    for path in folder.glob("config.resume_*.yaml"):
        match = re.fullmatch(r"config\.resume_(\d+)\.yaml", path.name)
        if match is not None and int(match.group(1)) <= step:
            found[int(match.group(1))] = path
    return found[max(found)] if found else None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _within(key: str, prefixes: Collection[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def changed_keys(
    saved: dict[str, Any], now: dict[str, Any], derived: Collection[str] = ()
) -> list[tuple[str, Any, Any]]:
    """(key, saved value, value now) for every checked key that differs (see
    ``giantpipe.config.RESUME_CHECKED``); ``derived`` keys (set by an interpolation such as
    ``model.in_features: ${data.features}``) follow their source and are not compared.

    Example::

        changed_keys({"trainer": {"seed": 0}}, {"trainer": {"seed": 1}})
        # [("trainer.seed", 0, 1)]
    """
    before, after = _flat(saved), _flat(now)
    for flat in (before, after):  # a builder that moved is the same builder
        for key, value in flat.items():
            if key.endswith("._target_") and isinstance(value, str):
                flat[key] = current_target(value)
    absent = object()
    keys = sorted(k for k in before.keys() | after.keys() if _within(k, RESUME_CHECKED))
    return [
        (k, before.get(k, absent), after.get(k, absent))
        for k in keys
        if k not in derived and before.get(k, absent) != after.get(k, absent)
    ]


def _value(value: Any) -> str:
    if not isinstance(value, str | int | float | bool | list | dict | None):
        return "(absent)"
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def check_resumed_config(
    checkpoint: Path,
    step: int,
    config_yaml: str,
    allowed: Sequence[str] = (),
    derived: Collection[str] = (),
) -> None:
    """Refuse a resume that would change what the run trains on: ``trainer.seed`` (the batch
    order), any ``model.*`` or ``data.*`` key, compared with the config the run saved, unless
    ``allowed`` (``trainer.resume_changed``) names the key or a group above it. One line names
    the keys, the saved and the new values. A checkpoint without a saved config beside it (a
    copied folder) is not checked.

    Example::

        check_resumed_config(run / "last", 40, new_yaml, allowed=["trainer.seed"])
    """
    path = saved_config(checkpoint, step)
    if path is None:
        log.info("no config.yaml beside %s: trainer.seed, model and data not compared", checkpoint)
        return
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        reason = " ".join(str(err).split())[:160]
        raise ConfigError(
            KEY,
            f"{path} is unreadable ({reason}), so the resume cannot be checked against the "
            "run's config: repair it, or move it aside to resume unchecked",
        ) from err
    now = yaml.safe_load(config_yaml)
    if not (isinstance(saved, dict) and isinstance(now, dict)):
        return
    changes = [c for c in changed_keys(saved, now, derived) if not _within(c[0], allowed)]
    if not changes:
        return
    names = [key for key, _, _ in changes]
    shown = ", ".join(f"{key} {_value(old)} -> {_value(new)}" for key, old, new in changes[:3])
    more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    raise ConfigError(
        ", ".join(names[:3]) + (", ..." if more else ""),
        f"changed from the run being resumed ({path}: {shown}{more}); a resume continues that "
        f"run: set {'it' if len(names) == 1 else 'them'} back, or pass "
        f"trainer.resume_changed=[{','.join(names)}] if the change is meant",
    )


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` if needed; ConfigError naming it unless the run can write there."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError("hydra.run.dir", f"cannot create {run_dir} ({err.strerror})") from err
    if not os.access(run_dir, os.W_OK):
        raise ConfigError("hydra.run.dir", f"cannot write to {run_dir}")


def save_config(run_dir: Path, config_yaml: str, resumed_at: int | None) -> Path:
    """Write the resolved config: ``config.yaml``, or ``config.resume_<step>.yaml`` on a resume
    (the original stays as it was)."""
    name = "config.yaml" if resumed_at is None else f"config.resume_{resumed_at}.yaml"
    path = run_dir / name
    path.write_text(config_yaml)
    return path


def move_record_aside(run_dir: Path) -> Path:
    """``trainer.overwrite``: the old record's files into ``replaced-N/`` (nothing is deleted)."""
    n = 1
    while (run_dir / f"replaced-{n}").exists():
        n += 1
    aside = run_dir / f"replaced-{n}"
    aside.mkdir()
    for path in sorted(run_dir.iterdir()):
        # The pictures, traces and TensorBoard events too: a new run appending events to the
        # old ones would draw both runs as one.
        drawn = ("config", "timeline_", "trace-step", "error.txt", "curves.png", "tensorboard")
        if path.name in RECORD or path.name.startswith(drawn):
            path.rename(aside / path.name)
    log.info("trainer.overwrite: the earlier record of %s moved to %s", run_dir, aside)
    return aside


# -- one run at a time -------------------------------------------------------------------------


def _started(pid: int) -> str | None:
    """The process's start time as the kernel counts it (Linux), to tell a reused PID apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return started is None or _started(pid) in (None, started)


class RunLock:
    """Holds ``RUN/.giantpipe.lock`` while a run writes its directory.

    Example::

        with RunLock(run_dir):      # ConfigError naming the holder if another run is there
            train()
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self.me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _started(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Takes the lock, or a lock left by a dead process (saying so); else ConfigError."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            self._take_over()
            return
        with os.fdopen(fd, "w") as handle:
            json.dump(self.me, handle)

    def _take_over(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            holder = {}  # torn by a crash while it was written: nobody holds it
        pid, host = int(holder.get("pid", 0)), holder.get("host", "?")
        if pid and host == self.me["host"] and _alive(pid, holder.get("started")):
            raise self._busy(pid, host, holder.get("since", "?"))
        if pid and host != self.me["host"]:
            raise self._busy(pid, host, holder.get("since", "?"), other_host=True)
        tmp = self.path.with_name(f"{LOCK}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.me))
        os.replace(tmp, self.path)
        if json.loads(self.path.read_text()).get("pid") != os.getpid():
            raise self._busy(pid, host, "just now")  # another run took it over first
        log.info("took over %s from PID %s on %s, which is gone", self.path, pid or "?", host)

    def _busy(self, pid: int, host: str, since: str, other_host: bool = False) -> ConfigError:
        hint = f"; if it is gone, delete {self.path}" if other_host else ""
        return ConfigError(
            "hydra.run.dir",
            f"{self.path.parent} is in use by PID {pid} on {host} (since {since}); wait for "
            f"that run to end or choose another hydra.run.dir{hint}",
        )

    def release(self) -> None:
        """Removes the lock if it is still this process's."""
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass


# -- what a killed save leaves behind ----------------------------------------------------------


def checkpoint_directories(run_dir: Path) -> list[Path]:
    """The run's own checkpoint directories: ``last/`` and ``step_N/``."""
    numbered = [p for p in run_dir.glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return [p for p in [run_dir / LAST, *sorted(numbered)] if p.is_dir()]


def clean_interrupted_saves(run_dir: Path) -> int:
    """Removes what killed saves left in the run's checkpoint directories
    (:func:`giantpipe.checkpoint.cleanup.interrupted`) and checkpoints a killed removal set
    aside (:func:`giantpipe.checkpoint.cleanup.set_aside`), and nothing else. Call it after the
    checkpoint to resume from has been read. Returns how many files and folders went.

    Example::

        clean_interrupted_saves(Path("outputs/2026-12-01/10-00-00"))   # 1
    """
    removed = [path for folder in checkpoint_directories(run_dir) for path in interrupted(folder)]
    removed += set_aside(run_dir)  # checkpoints whose removal (retention) was killed
    for path in removed:
        remove(path)
    if removed:
        log.info("removed %d leftovers of interrupted saves in %s", len(removed), run_dir)
    return len(removed)


def kept_beside(directory: Path) -> Path | None:
    """The newest other checkpoint of the same run (``step_N/`` beside ``directory``) whose
    manifest reads, to offer when ``directory`` is damaged."""
    here = directory.resolve()
    numbered = [p for p in here.parent.glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    for path in sorted(numbered, key=lambda p: int(p.name[5:]), reverse=True):
        if path.resolve() == here:
            continue
        try:
            read_manifest(path)
        except (OSError, ValueError):
            continue
        return directory.parent / path.name
    return None
