"""What a run keeps and when it stops early, on rank 0: the ledger of its evaluations and
``step_N/``, the retention of ``trainer.keep_last`` / ``trainer.keep_best``, and early stopping.

Every rank acts on rank 0's verdicts (the loop shares them), so all save and stop together.

Example::

    keeping = Keeping.open(cfg, run_dir, step=progress.step)    # None: nothing configured
    best, stop = keeping.judge(40, {"eval/loss": 0.41})           # after each evaluation
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from giantpipe.config import ExperimentConfig
from giantpipe.runner.early_stop import EarlyStopping
from giantpipe.runner.ledger import Ledger, folder_name
from giantpipe.runner.monitor import Monitor
from giantpipe.runner.retention import Retention


def configured(cfg: ExperimentConfig) -> bool:
    """Whether the run keeps a ledger: trainer.keep_last, keep_best or early stopping is set."""
    trainer = cfg.trainer
    return bool(trainer.keep_last is not None or trainer.keep_best or trainer.early_stop_patience)


def judges(cfg: ExperimentConfig) -> bool:
    """Whether evaluations have verdicts to share: keep_best or early stopping is set."""
    return bool(cfg.trainer.keep_best or cfg.trainer.early_stop_patience)


@dataclass
class Keeping:
    """Rank 0's ledger, retention (None without keep_last and keep_best) and early stopping
    (None without trainer.early_stop_patience)."""

    ledger: Ledger
    retention: Retention | None
    early_stop: EarlyStopping | None

    @classmethod
    def open(cls, cfg: ExperimentConfig, run_dir: Path, step: int) -> Keeping | None:
        """Opens the ledger of a run starting at ``step`` (finishing removals a kill
        interrupted); early stopping counts on from the run's earlier evaluations."""
        if not configured(cfg):
            return None
        trainer = cfg.trainer
        ledger = Ledger.open(run_dir, step)
        monitor = Monitor.of(cfg) if judges(cfg) else None
        retention = None
        if trainer.keep_last is not None or trainer.keep_best:
            retention = Retention(ledger, monitor, trainer.keep_last, trainer.keep_best)
        early_stop = None
        if trainer.early_stop_patience is not None and monitor is not None:
            patience, delta = trainer.early_stop_patience, trainer.early_stop_min_delta
            early_stop = EarlyStopping(monitor, patience, delta)
            early_stop.replay(ledger.evaluations)
        return cls(ledger, retention, early_stop)

    def judge(self, step: int, figures: dict[str, float]) -> tuple[bool, str | None]:
        """After the evaluation of ``step`` (its ``eval/`` figures): whether it is saved as one
        of the best, and why the run stops early (None: it goes on)."""
        self.ledger.evaluated(step, figures)
        best = self.retention.wants_best(step) if self.retention is not None else False
        stop = self.early_stop.observe(step, figures) if self.early_stop is not None else None
        return best, stop

    def planned(self, step: int, why: list[str]) -> None:
        """Before ``step_N/`` is written (why: retention.EVERY, retention.BEST)."""
        if self.retention is not None:
            self.retention.planned(step, why)

    def tagged(self, step: int, why: list[str]) -> None:
        """``step_N/``, written already, is kept for ``why`` too (the final evaluation comes
        after the last step's save): the ranking is decided again."""
        if self.retention is not None:
            self.ledger.planned(step, why)
            self.retention.prune()

    def committed(self, directory: Path, step: int) -> None:
        """A save is committed: a ``step_N/`` of the retention's prunes the others."""
        if self.retention is not None and directory.name == folder_name(step):
            self.retention.committed(step)

    def summary(self) -> dict[str, Any]:
        """What summary.json says of the checkpoints kept and removed."""
        if self.retention is None:
            return {}
        return {
            "checkpoints/kept": self.retention.summary(),
            "checkpoints/removed": len(self.retention.removed),
        }
