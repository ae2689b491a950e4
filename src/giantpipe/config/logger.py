"""Where metrics go (progress bar, metrics.jsonl, W&B, TensorBoard): the ``logger`` group's schema.

Example::

    from giantpipe.config import LoggerConfig

    LoggerConfig(progress="none", wandb=True, wandb_mode="offline")
"""

from __future__ import annotations

from dataclasses import dataclass

from giantpipe.config.checks import check_choice

PROGRESS_STYLES = ("auto", "tqdm", "none")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggerConfig:
    """Where metrics go: progress bar, ``metrics.jsonl``, optionally Weights & Biases and
    TensorBoard."""

    progress: str = "auto"
    """``auto`` (a tqdm bar when stdout is a terminal), ``tqdm`` (always) or ``none``."""
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
        check_choice(self.wandb_mode, WANDB_MODES, "logger.wandb_mode")
