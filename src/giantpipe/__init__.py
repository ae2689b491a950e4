"""giantpipe: GPipe pipeline parallelism with a config-driven experiment runner.

Example::

    import torch
    from torch import nn
    from giantpipe import GPipe

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = GPipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=4)
    loss = pipe(torch.randn(16, 8)).sum()
    loss.backward()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from giantpipe.engine import GPipe, PipelineError, is_recomputing, sequentialize, verify_module
    from giantpipe.perf.balance import balance_by_params, balance_by_size, balance_by_time

# Loaded on first use (PEP 562): ``import giantpipe.config`` must not import torch, so that the
# command line checks a config in a fraction of a second (see giantpipe.cli).
_EXPORTS = {
    "GPipe": "giantpipe.engine",
    "PipelineError": "giantpipe.engine",
    "is_recomputing": "giantpipe.engine",
    "sequentialize": "giantpipe.engine",
    "verify_module": "giantpipe.engine",
    "balance_by_params": "giantpipe.perf.balance",
    "balance_by_size": "giantpipe.perf.balance",
    "balance_by_time": "giantpipe.perf.balance",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'giantpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later look-ups do not come back here
    return value


__all__ = [
    "GPipe",
    "PipelineError",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "is_recomputing",
    "sequentialize",
    "verify_module",
]
__version__ = "0.1.0"
