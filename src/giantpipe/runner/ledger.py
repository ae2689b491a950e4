"""The run's ledger of kept checkpoints, ``RUN/checkpoints.json``, and the crash-safe removal of
a ``step_N/`` that giantpipe wrote.

The ledger holds the run's evaluations (their ``eval/`` figures by step), the ``step_N/`` it
wrote and why (``every``: trainer.checkpoint_every, ``best``: trainer.keep_best) and the
removals under way. A removal is decided, recorded, then done: the folder is renamed
``step_N.removing`` (out of every resume's sight at once), then deleted; the next start finishes
what the ledger says was being removed. Only a folder whose manifest commits a run checkpoint of
its own step, and that holds nothing but giantpipe's files, is ever removed
(docs/running.md#keeping-checkpoints). Rank 0 alone keeps the ledger.

Example::

    ledger = Ledger.open(run_dir, step=40)     # finishes a removal a kill interrupted
    ledger.remove(20, "not among the 2 newest (trainer.keep_last)")
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from giantpipe.checkpoint.earlier import SHARDS_V1_FILE
from giantpipe.checkpoint.files import atomic_write_text, fsync_directory
from giantpipe.checkpoint.manifest import read_manifest
from giantpipe.checkpoint.names import IN_FOLDER, MANIFEST, MANIFEST_TMP, SAVE_FOLDER
from giantpipe.checkpoint.run import RUN_FORMAT
from giantpipe.runner.rundir import checkpoint_directories

log = logging.getLogger(__name__)

LEDGER = "checkpoints.json"
FORMAT = "giantpipe-kept/1"
REMOVING = ".removing"
"""The suffix of a ``step_N/`` being removed (``step_20.removing``)."""
STEP_FOLDER = re.compile(r"step_(\d+)")


def folder_name(step: int) -> str:
    """``step_N``, the name of the checkpoint of step N."""
    return f"step_{step}"


def strangers(folder: Path) -> str | None:
    """What in ``folder`` giantpipe did not write (one line), or None: a checkpoint folder
    holds its manifest and save folders of DCP's and the run's files, nothing else."""
    if folder.is_symlink() or not folder.is_dir():
        return "it is a link or no folder"
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if entry.is_symlink():
            return f"it holds {name}, a link"
        if entry.is_file() and (
            name == MANIFEST or MANIFEST_TMP.fullmatch(name) or SHARDS_V1_FILE.fullmatch(name)
        ):
            continue
        if entry.is_dir() and SAVE_FOLDER.fullmatch(name):
            odd = [p.name for p in entry.iterdir() if p.is_symlink() or not p.is_file()]
            odd += [p.name for p in entry.iterdir() if not IN_FOLDER.fullmatch(p.name)]
            if not odd:
                continue
            return f"it holds {name}/{sorted(odd)[0]}, which giantpipe did not write"
        return f"it holds {name}, which giantpipe did not write"
    return None


def not_ours(folder: Path, step: int) -> str | None:
    """Why ``folder`` is no checkpoint of step ``step`` that giantpipe wrote (one line), or
    None when it is one: its manifest commits a run checkpoint of that step, and it holds
    nothing else but giantpipe's files."""
    if folder.is_symlink() or not folder.is_dir():  # never followed: it may be anyone's
        return "it is a link or no folder"
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as err:
        return f"its {MANIFEST} does not read ({err})"
    if (manifest.get("extra") or {}).get("format") != RUN_FORMAT:
        return "it holds no run checkpoint"
    if manifest.get("step") != step:
        return f"its manifest is of step {manifest.get('step')}"
    return strangers(folder)


def one_per_line(data: dict[str, Any]) -> str:
    """JSON of a mapping whose lists show one item a line (an evaluation, a step's reasons).

    >>> print(one_per_line({"removing": [], "written": [[2, ["every"]], [4, ["best"]]]}), end="")
    {
     "removing": [],
     "written": [
      [2, ["every"]],
      [4, ["best"]]
     ]
    }
    """
    entries = []
    for key, value in data.items():
        if isinstance(value, list) and value:
            items = ",\n".join(f"  {json.dumps(item)}" for item in value)
            entries.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            entries.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(entries) + "\n}\n"


def set_aside(folder: Path) -> Path:
    """Renames ``step_N/`` to ``step_N.removing`` (durably): no resume sees it from then on."""
    aside = folder.with_name(folder.name + REMOVING)
    if aside.exists():  # an earlier removal of a folder of that name, left unfinished
        erase(aside)
    folder.rename(aside)
    fsync_directory(folder.parent)
    return aside


def erase(folder: Path) -> None:
    """Deletes a folder set aside (OSError if some of it could not go)."""
    shutil.rmtree(folder)


@dataclass
class Ledger:
    """``RUN/checkpoints.json``: evaluations, the ``step_N/`` written and why, removals."""

    run_dir: Path
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)
    """Each evaluation's ``eval/`` figures, by step."""
    written: dict[int, list[str]] = field(default_factory=dict)
    """The ``step_N/`` the run wrote (and may remove), by step: why each was written."""
    removing: list[str] = field(default_factory=list)
    """Folders being removed (``step_N``; renamed ``step_N.removing`` once set aside)."""

    @property
    def path(self) -> Path:
        return self.run_dir / LEDGER

    @classmethod
    def read(cls, run_dir: Path) -> Ledger:
        """The ledger as written (an empty one if there is none, or it does not read)."""
        path = run_dir / LEDGER
        if not path.exists():
            return cls(run_dir)
        try:
            data = json.loads(path.read_text())
            return cls(
                run_dir,
                {int(s): dict(f) for s, f in data["evaluations"]},
                {int(s): list(why) for s, why in data["written"]},
                [str(name) for name in data["removing"]],
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning(
                "%s does not read (%s); the step_N/ on disk are taken as written", path, err
            )
            return cls(run_dir)

    @classmethod
    def open(cls, run_dir: Path, step: int) -> Ledger:
        """The ledger of a run starting at ``step`` (after its checkpoint was read): removals a
        kill interrupted are finished, evaluations after ``step`` (a course the run left) are
        dropped, and the ``step_N/`` up to ``step`` are what is on disk: the checkpoints of
        giantpipe's written before the ledger knew them are taken as trainer.checkpoint_every's,
        the folders it does not recognize are left alone."""
        ledger = cls.read(run_dir)
        ledger.finish_removals()
        ledger.evaluations = {s: f for s, f in ledger.evaluations.items() if s <= step}
        written = {}
        for folder in checkpoint_directories(run_dir):
            match = STEP_FOLDER.fullmatch(folder.name)
            if match is None or int(match.group(1)) > step:
                continue
            number = int(match.group(1))
            problem = not_ours(folder, number)
            if problem is None:
                written[number] = ledger.written.get(number, ["every"])
            else:
                log.info("%s is left as it is: %s", folder, problem)
        ledger.written = written
        ledger.write()
        return ledger

    def write(self) -> None:
        """Writes the ledger whole (the old one or the new one is on disk, never a torn one)."""
        data: dict[str, Any] = {
            "format": FORMAT,
            "evaluations": sorted(self.evaluations.items()),
            "written": sorted(self.written.items()),
            "removing": self.removing,
        }
        atomic_write_text(one_per_line(data), self.path)

    def record(self) -> bool:
        """:meth:`write`, in the run: a ledger that cannot be written (a full disk) is a
        warning, not the run's end; nothing is removed unless its removal is recorded."""
        try:
            self.write()
        except OSError as err:
            log.warning("%s: not written (%s); no checkpoint is removed meanwhile", self.path, err)
            return False
        return True

    def evaluated(self, step: int, figures: dict[str, float]) -> None:
        """Records an evaluation's ``eval/`` figures."""
        self.evaluations[step] = dict(figures)
        self.record()

    def planned(self, step: int, why: list[str]) -> None:
        """Records, before it is written, that the run saves ``step_N/`` and why."""
        self.written[step] = sorted(set(self.written.get(step, [])) | set(why))
        self.record()

    def remove(self, step: int, why: str) -> bool:
        """Removes ``step_N/`` if giantpipe wrote it: decided (``why``), recorded, set aside,
        deleted. False if it stays: not recognized (it then leaves the ledger), or the
        removal could not be recorded or done (tried again later)."""
        folder = self.run_dir / folder_name(step)
        problem = not_ours(folder, step)
        if problem is not None:
            log.warning("%s is kept although %s: %s", folder, why, problem)
            self.written.pop(step, None)
            self.record()
            return False
        reasons = self.written.pop(step, [])
        self.removing.append(folder.name)
        if not self.record():
            self.removing.remove(folder.name)
            self.written[step] = reasons
            return False
        try:
            erase(set_aside(folder))
        except OSError as err:  # the next start tries again; the run goes on
            log.warning("%s: not removed (%s); the next start tries again", folder, err)
            return False
        self.removing.remove(folder.name)
        self.record()
        log.info("removed %s: %s", folder, why)
        return True

    def finish_removals(self) -> None:
        """Finishes the removals a kill interrupted: a folder set aside goes (what is left of
        it, if nothing in it is a stranger's); one not yet set aside is whole, and stays."""
        for name in list(self.removing):
            aside = self.run_dir / (name + REMOVING)
            problem = strangers(aside) if aside.exists() else None
            if aside.exists() and problem is None:
                try:
                    erase(aside)
                    log.info("finished removing %s (interrupted)", self.run_dir / name)
                except OSError as err:
                    log.warning("%s: not removed (%s)", aside, err)
                    continue
            elif aside.exists():
                log.warning("%s is left as it is: %s", aside, problem)
            self.removing.remove(name)
        self.write()
