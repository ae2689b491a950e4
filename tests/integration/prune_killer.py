"""A tiny run killed (SIGKILL) inside its first pruning, at a chosen point of the removal, for
tests/integration/test_keep_kill.py: ``python -m tests.integration.prune_killer RUN POINT``.

POINT: ``recorded`` (the ledger says the folder goes; not yet set aside), ``set aside``
(renamed ``step_N.removing``; nothing deleted), ``half erased`` (half its files deleted).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from giantpipe.config import ExperimentConfig
from giantpipe.runner import ledger, train
from tests.support.runs import tiny

POINTS = ("recorded", "set aside", "half erased")


def config(**trainer: object) -> ExperimentConfig:
    """Saves step_2, 4, 6, 8 and keeps the 2 newest: the first pruning removes step_2."""
    values = {"max_steps": 8, "eval_every": 2, "checkpoint_every": 2, "keep_last": 2}
    return tiny(predict=False, **{**values, **trainer})


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as kill -9: no handler, no cleanup, no flush


def half_erase(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files[: len(files) // 2]:
        path.unlink()
    die()


def main(run_dir: Path, point: str) -> None:
    if point == "recorded":
        ledger.set_aside = lambda folder: die()
    elif point == "set aside":
        ledger.erase = lambda folder: die()
    else:
        ledger.erase = half_erase
    train(config(), run_dir, "")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
