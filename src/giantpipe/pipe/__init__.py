"""The pipeline engine. Imports torch only: no Hydra, no runner, no models.

Example::

    from giantpipe.pipe import GPipe, balance_by_time

    balance = balance_by_time(2, model, sample_microbatch)
    pipe = GPipe(model, balance, devices=["cpu", "cpu"], chunks=8, checkpoint="except_last")
    loss = pipe.train_step(x, y, torch.nn.functional.cross_entropy)
    print(pipe.last_stats)
"""

from giantpipe.pipe.balance import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    solve_balance,
)
from giantpipe.pipe.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from giantpipe.pipe.checkpoint import is_recomputing
from giantpipe.pipe.executor import PipelineError
from giantpipe.pipe.gpipe import GPipe
from giantpipe.pipe.mailbox import PipelineTimeout
from giantpipe.pipe.rng import rng_context
from giantpipe.pipe.schedule import Action, Schedule, build_schedule, expected_bubble, gpipe
from giantpipe.pipe.stats import StepStats

__all__ = [
    "Action",
    "DeferredBatchNorm",
    "GPipe",
    "PipelineError",
    "PipelineTimeout",
    "Schedule",
    "StepStats",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "build_schedule",
    "convert_deferred_batch_norm",
    "expected_bubble",
    "gpipe",
    "is_recomputing",
    "rng_context",
    "solve_balance",
]
