"""The pipeline engine: runs one step of a partitioned ``nn.Sequential``. Imports torch only.

What lives here: schedules as data (:mod:`.schedule`, :mod:`.schedules`), partitioning and
micro-batching, re-materialization (:mod:`.recompute`), deferred BatchNorm, dropout RNG replay,
the local executor (:mod:`.executor`, a worker thread per device) behind :class:`GPipe`, and
the distributed executor (:mod:`.dist`, a process per device). Nothing here imports Hydra, the
runner, the cost model (:mod:`giantpipe.perf`) or ``models``; anything may import this package.

Example::

    from giantpipe.engine import GPipe

    pipe = GPipe(model, balance=[4, 4], devices=["cpu", "cpu"], chunks=8)
    loss = pipe.train_step(x, y, torch.nn.functional.cross_entropy)
    print(pipe.last_stats)
"""

from giantpipe.engine.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from giantpipe.engine.executor import PipelineError
from giantpipe.engine.gpipe import GPipe
from giantpipe.engine.recompute import is_recomputing
from giantpipe.engine.rng import rng_context
from giantpipe.engine.schedule import Action, Schedule, expected_bubble, gpipe
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.stats import StepStats
from giantpipe.engine.workers import PipelineTimeout

__all__ = [
    "Action",
    "DeferredBatchNorm",
    "GPipe",
    "PipelineError",
    "PipelineTimeout",
    "Schedule",
    "StepStats",
    "build_schedule",
    "convert_deferred_batch_norm",
    "expected_bubble",
    "gpipe",
    "is_recomputing",
    "rng_context",
]
