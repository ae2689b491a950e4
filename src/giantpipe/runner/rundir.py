"""The run directory: where a run starts or resumes, one run at a time, nothing left half-written.

Decided before anything is written:

- a fresh run refuses a directory that holds a checkpoint (``last/``, or a ``last.pt`` of the
  earlier format) or another run's record without one (``metrics.jsonl``, ``summary.json``;
  ``trainer.overwrite=true`` moves that record aside into ``replaced-N/`` instead);
- a resume needs a checkpoint, and one from elsewhere may not replace the run this directory
  holds;
- one run at a time: :class:`RunLock` (``.giantpipe.lock``, the holder's PID, host and start)
  refuses a second run naming the holder, and takes over a lock whose process is gone.

Once the checkpoint to resume from has been read, :func:`clean_interrupted_saves` removes
what killed saves left in the run's checkpoint directories, under giantpipe's own names only.

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
import shutil
import socket
import time
from pathlib import Path

from giantpipe.config import ConfigError
from giantpipe.engine.dist.shards import MANIFEST, stale

log = logging.getLogger(__name__)

LAST = "last"
"""The checkpoint directory refreshed at every evaluation and at the end."""
LEGACY_LAST = "last.pt"
"""The same, as the earlier one-file format wrote it."""
LOCK = ".giantpipe.lock"
RECORD = ("metrics.jsonl", "summary.json")
"""Files that say a directory holds a run's record."""
KEY = "trainer.resume"


def held_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``run_dir`` holds, if any: ``last/`` or a legacy ``last.pt``."""
    if (run_dir / LAST / MANIFEST).is_file():
        return run_dir / LAST
    if (run_dir / LEGACY_LAST).exists():
        return run_dir / LEGACY_LAST
    return None


def _shown(path: Path, run_dir: Path) -> str:
    name = path.relative_to(run_dir)
    return f"{name}/{MANIFEST}" if path.is_dir() else str(name)


def resume_point(resume: bool | str, run_dir: Path, overwrite: bool = False) -> Path | None:
    """The checkpoint to resume from (a directory, or a ``.pt`` of the earlier format), or None
    for a fresh run; ConfigError when the request cannot be met. A checkpoint from elsewhere
    may not replace the run ``run_dir`` holds; one of its own kept ``step_N/`` may.

    Example::

        resume_point(True, Path("outputs/2024-05-01/10-00-00"))   # .../last
    """
    held = held_checkpoint(run_dir)
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
        if path.name in RECORD or path.name.startswith(("config", "timeline_", "error.txt")):
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
    """Removes what killed saves left in the run's checkpoint directories, and nothing else:
    save folders and temporary manifests under giantpipe's own names that the directory's
    manifest does not commit (:func:`giantpipe.engine.dist.shards.stale`). A directory whose
    manifest cannot be read is left as it is, and so is everything outside ``last/`` and
    ``step_N/``. Call it after the checkpoint to resume from has been read. Returns how many
    files and folders went.

    Example::

        clean_interrupted_saves(Path("outputs/2026-12-01/10-00-00"))   # 1
    """
    removed = [path for folder in checkpoint_directories(run_dir) for path in stale(folder)]
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if removed:
        log.info("removed %d leftovers of interrupted saves in %s", len(removed), run_dir)
    return len(removed)
