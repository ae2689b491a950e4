"""Seeding: the process's random-number generators, seeded once at the start of a run
(:func:`seed_everything`), and their states captured and put back (:func:`rng_state`,
:func:`restore_rng`), which every checkpoint saves.

Example::

    seed_everything(0)
    state = rng_state()
    restore_rng(state)       # the same draws again
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy's global generator (if numpy is loaded) and torch."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if "numpy" in sys.modules:
        # Only when something already imported numpy: the runner itself does not use it.
        sys.modules["numpy"].random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    """Every generator's state, picklable (tensors on CPU)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        # As plain values (its key array as a list), so checkpoints load with weights_only.
        kind, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` captured (generators absent here are skipped)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
