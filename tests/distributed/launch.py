"""Moved to tests/support/ranks.py (and ``train_under_torchrun`` to tests/support/train.py); these
names stay until the tests other lanes are editing import them from there
(tests/unit/test_test_tools.py lists them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.ranks import REPO, finish, spawn, start_ranks
from tests.support.train import train_under_torchrun

__all__ = ["REPO", "finish", "spawn", "start_processes", "train_under_torchrun"]


def start_processes(world: int, target: str, tmp: Path, **kwargs: Any) -> list[Any]:
    """:func:`tests.support.ranks.start_ranks` under its old name and argument order."""
    return start_ranks(target, world, tmp, **kwargs)
