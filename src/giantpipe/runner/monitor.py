"""The monitored eval figure that ``trainer.keep_best`` and early stopping rank evaluations by.

>>> loss = Monitor("eval/loss", "min")
>>> loss.better(0.40, 0.50), loss.better(0.49, 0.50, by=0.05), loss.ranked({2: 0.5, 4: 0.3, 6: 0.4})
(True, False, [4, 6, 2])
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.config.trainer import monitored
from giantpipe.runner.record import figures_of


@dataclass(frozen=True)
class Monitor:
    """An eval figure (``eval/loss``) and which way it improves (``min`` or ``max``)."""

    key: str
    mode: str

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> Monitor:
        """trainer.monitor and trainer.monitor_mode, else sweep.objective and its direction."""
        return cls(*monitored(cfg.trainer, cfg.sweep))

    def value(self, figures: Mapping[str, float]) -> float | None:
        """The figure in an evaluation's ``eval/`` figures; None when absent or not finite."""
        value = figures.get(self.key)
        if not isinstance(value, int | float) or not math.isfinite(value):
            return None
        return float(value)

    def better(self, value: float, than: float, by: float = 0.0) -> bool:
        """Whether ``value`` improves on ``than`` by more than ``by`` (a tie does not)."""
        return value < than - by if self.mode == "min" else value > than + by

    def ranked(self, scores: Mapping[int, float]) -> list[int]:
        """The steps of ``scores`` best first; of equal scores the earlier step first."""
        sign = 1.0 if self.mode == "min" else -1.0
        return sorted(scores, key=lambda step: (sign * scores[step], step))


def check_monitor(cfg: ExperimentConfig, parts: Any) -> None:
    """Before the run trains: the monitored figure is one this run reports (the data's own
    evaluation, e.g. BLEU, may add ``eval/`` figures of its own)."""
    if not (cfg.trainer.keep_best or cfg.trainer.early_stop_patience is not None):
        return
    key, known = Monitor.of(cfg).key, figures_of(cfg, parts)
    if key in known or parts.bundle.evaluate_model is not None:
        return
    choices = ", ".join(sorted(k for k in known if k.startswith("eval/")))
    setting = "trainer.monitor" if cfg.trainer.monitor else "sweep.objective"
    raise ConfigError(
        "trainer.monitor",
        f"{key!r} ({setting}) is not a figure this run's evaluation reports; choose one of "
        f"{choices}",
    )
