"""Testing helpers: what tests, benchmarks and recipes use to check a pipeline and start ranks.

Its modules: :mod:`.reference` (the plain reference step), :mod:`.world` (a world of ranks on
this machine), :mod:`.gpu` (CUDA devices or CPU stand-ins), :mod:`.outputs` (where a script
writes its report), :mod:`.held` and :mod:`.reads` (what a process holds, and reads from disk).
It sits beside the entry points; the library itself never imports it. Its public names are each
imported from their module on first use, so a script reads :mod:`.outputs` before torch loads.

Example::

    from giantpipe.testing import reference_step, step_seed

    plain, loss = reference_step(model, x, y, chunks=4, seed=step_seed(3))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from giantpipe.testing.reference import (
        accumulate_micro_batches,
        plain_forward,
        reference_step,
        step_seed,
    )
    from giantpipe.testing.world import free_port, rank_env

_HOMES = {
    "accumulate_micro_batches": "reference",
    "free_port": "world",
    "plain_forward": "reference",
    "rank_env": "world",
    "reference_step": "reference",
    "step_seed": "reference",
}

__all__ = [
    "accumulate_micro_batches",
    "free_port",
    "plain_forward",
    "rank_env",
    "reference_step",
    "step_seed",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'giantpipe.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"giantpipe.testing.{_HOMES[name]}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
