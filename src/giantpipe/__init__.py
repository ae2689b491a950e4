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

from giantpipe.engine import GPipe, PipelineError, is_recomputing, sequentialize, verify_module
from giantpipe.perf.balance import balance_by_params, balance_by_size, balance_by_time

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
