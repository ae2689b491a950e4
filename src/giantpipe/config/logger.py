"""Where metrics go (progress bar or lines, metrics.jsonl, W&B, TensorBoard): the ``logger``
group's schema.

Example::

    from giantpipe.config import LoggerConfig

    LoggerConfig(progress="none", wandb=True, wandb_mode="offline")
"""

from __future__ import annotations

from dataclasses import dataclass

from giantpipe.config.checks import check, check_choice

PROGRESS_STYLES = ("auto", "tqdm", "lines", "none")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggerConfig:
    """Where metrics go: progress bar or lines, ``metrics.jsonl``, optionally Weights & Biases
    and TensorBoard."""

    progress: str = "auto"
    """``auto`` (a tqdm bar when stdout is a terminal, progress lines in the log when it is not:
    nohup, a cluster job), ``tqdm`` (always a bar), ``lines`` (always lines) or ``none``."""
    progress_every_s: float = 30.0
    """Progress lines: one at every ``trainer.log_every`` step and at least one every this many
    seconds (at the next step boundary)."""
    jsonl: bool = True
    """Append one JSON line per logging step to ``metrics.jsonl`` in the run directory."""
    wandb: bool = False
    """Also log to Weights & Biases (``logger=wandb``)."""
    wandb_project: str = "giantpipe"
    """W&B project name."""
    wandb_mode: str = "offline"
    """``offline`` (no network; sync later with ``wandb sync``), ``online`` or ``disabled``."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to ``RUN_DIR/tensorboard`` (needs ``tensorboard``)."""

    def __post_init__(self) -> None:
        check_choice(self.progress, PROGRESS_STYLES, "logger.progress")
        check(self.progress_every_s > 0, "logger.progress_every_s", "must be > 0 seconds")
        check_choice(self.wandb_mode, WANDB_MODES, "logger.wandb_mode")
