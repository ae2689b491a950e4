"""Ranks reading their share of a model's weights as ``trainer.init_from`` does, each measuring
what it read from disk (what tests/distributed/test_checkpoint_share.py spawns)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from giantpipe.testing.reads import Layouts, read_my_share


def read_share_of(tmp: Path, source: str, shares: list[Layouts]) -> dict[str, Any]:
    """This rank's share of ``source``: see :func:`giantpipe.testing.reads.read_my_share`."""
    return read_my_share(Path(source), shares)
