"""What a job returns to Hydra's sweeper: the ``sweep`` group's schema.

Example::

    from giantpipe.config import SweepConfig

    SweepConfig(objective="eval/accuracy", direction="maximize")
"""

from __future__ import annotations

from dataclasses import dataclass

from giantpipe.config.checks import check, check_choice

DIRECTIONS = ("minimize", "maximize")


@dataclass
class SweepConfig:
    """What a job returns to Hydra's sweeper (Optuna and friends optimize this)."""

    objective: str = "eval/loss"
    """A key of summary.json, e.g. ``eval/loss``, ``eval/accuracy``, ``train/samples_per_s``."""
    direction: str = "minimize"
    """``minimize`` or ``maximize`` (documentation for sweepers; failed jobs return NaN)."""

    def __post_init__(self) -> None:
        check(bool(self.objective), "sweep.objective", "must name a summary key")
        check_choice(self.direction, DIRECTIONS, "sweep.direction")
