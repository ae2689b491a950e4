"""What a checkpoint holds, and putting it back: the bridge between a run and checkpoint.py.

Example::

    atomic_save(capture(parts, progress), run_dir / "last.pt")
    progress = restore_checkpoint(parts, run_dir / "last.pt")     # resumes at the same step
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from giantpipe.config import ConfigError
from giantpipe.runner.build import Experiment
from giantpipe.runner.checkpoint import (
    FORMAT_VERSION,
    check_model_fits,
    load_checkpoint,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
)
from giantpipe.runner.seeding import restore_rng, rng_state


@dataclass
class Progress:
    """Where the run is: optimizer steps done and training batches consumed."""

    step: int = 0
    position: int = 0


def capture(parts: Experiment, progress: Progress) -> dict[str, Any]:
    """Everything needed to continue the run exactly, keyed by names, not by partition."""
    return {
        "format_version": FORMAT_VERSION,
        "step": progress.step,
        "position": progress.position,
        "model": parts.pipe.state_dict(),
        "optimizer": optimizer_state_by_name(parts.optimizer, parts.names),
        "scheduler": parts.scheduler.state_dict(),
        "ema": parts.ema.state_dict() if parts.ema is not None else None,
        "rng": rng_state(),
        "balance": list(parts.balance),
        "devices": list(parts.devices),
    }


def restore_checkpoint(parts: Experiment, path: Path) -> Progress:
    """Load ``path`` into the built parts (any balance); ConfigError if it does not fit."""
    state = load_checkpoint(path)
    check_model_fits(state["model"], parts.pipe.state_dict(), path)
    if parts.ema is not None and state.get("ema") is None:
        raise ConfigError("trainer.ema_decay", f"{path} was saved without an EMA of the weights")
    try:
        load_optimizer_state_by_name(parts.optimizer, state["optimizer"], parts.names)
    except (ValueError, KeyError) as err:
        raise ConfigError(
            "trainer.resume", f"{path}: optimizer state does not fit ({err})"
        ) from err
    parts.pipe.load_state_dict(state["model"])
    parts.scheduler.load_state_dict(state["scheduler"])
    if parts.ema is not None:
        parts.ema.load_state_dict(state["ema"])
    restore_rng(state["rng"])
    return Progress(step=int(state["step"]), position=int(state["position"]))
