"""The earlier ``.pt`` format: one file holding everything (``last.pt``), still read for
``trainer.resume`` (any balance) and for ``trainer.init_from``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from giantpipe.config import ConfigError
from giantpipe.runner.checkpoint.state import (
    RESUME,
    Progress,
    check_model_fits,
    load_optimizer_state_by_name,
)
from giantpipe.runner.checkpoint.unpickling import safe_load
from giantpipe.runner.seeding import restore_rng

if TYPE_CHECKING:
    from giantpipe.runner.build import Experiment

LEGACY_VERSION = 1
LEGACY_KEYS = ("format_version", "step", "position", "model", "optimizer", "rng")


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a ``.pt`` checkpoint of the earlier format onto the CPU; anything unreadable is a
    ConfigError naming the path."""
    if not path.is_file():
        raise ConfigError(RESUME, f"no checkpoint at {path}")
    state = safe_load(path, RESUME)
    if not isinstance(state, dict) or any(k not in state for k in LEGACY_KEYS):
        raise ConfigError(RESUME, f"{path} is not a giantpipe checkpoint")
    return state


def restore_legacy(parts: Experiment, path: Path, whole: bool = True) -> Progress:
    """Resume from a ``.pt`` file of the earlier format (any balance); ``whole``: this process
    holds the whole model (else: a torchrun rank, which takes its own names)."""
    state = load_checkpoint(path)
    live = parts.pipe.state_dict()
    saved = state["model"] if whole else {k: v for k, v in state["model"].items() if k in live}
    check_model_fits(saved, live, path)
    if parts.ema is not None and state.get("ema") is None:
        raise ConfigError("trainer.ema_decay", f"{path} was saved without an EMA of the weights")
    mine = set(parts.names)
    optimizer = {
        "state": {n: s for n, s in state["optimizer"]["state"].items() if n in mine},
        "param_groups": [
            {**g, "params": [n for n in g["params"] if n in mine]}
            for g in state["optimizer"]["param_groups"]
        ],
    }
    try:
        load_optimizer_state_by_name(parts.optimizer, optimizer, parts.names)
    except (ValueError, KeyError) as err:
        raise ConfigError(RESUME, f"{path}: optimizer state does not fit ({err})") from err
    parts.pipe.load_state_dict({k: v for k, v in state["model"].items() if k in live})
    parts.scheduler.load_state_dict(state["scheduler"])
    if parts.ema is not None:
        parts.ema.load_state_dict({n: t for n, t in state["ema"].items() if n in parts.ema.shadow})
    restore_rng(state["rng"])
    return Progress(step=int(state["step"]), position=int(state["position"]))
