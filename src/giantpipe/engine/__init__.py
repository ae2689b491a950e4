"""The pipeline engine: runs one step of a partitioned ``nn.Sequential``. Imports torch only.

Its public names (``GPipe``, ``PipelineSpec``, ``sequentialize``, ...) are each imported from the
module that defines it on first use, so :mod:`.spec` loads without torch. Its modules, a line
each: docs/architecture.md#module-map; how a step runs inside: docs/engine-internals.md. Nothing
here imports Hydra, the runner, ``models`` or the cost model (:mod:`giantpipe.perf` takes a
pipe); :mod:`.distributed` is imported only by who needs ``torch.distributed``.

Example::

    from giantpipe.engine import GPipe

    pipe = GPipe(model, balance=[4, 4], devices=["cpu", "cpu"], chunks=8)
    loss = pipe.train_step(x, y, torch.nn.functional.cross_entropy)
    print(pipe.last_stats)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from giantpipe.engine.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
    from giantpipe.engine.capture import CaptureError, sequentialize
    from giantpipe.engine.failures import PipelineError, PipelineTimeout, failed_action
    from giantpipe.engine.fp16 import pipeline_grad_scaler
    from giantpipe.engine.gpipe import GPipe
    from giantpipe.engine.partition import verify_module
    from giantpipe.engine.recompute import is_recomputing
    from giantpipe.engine.rng import rng_context
    from giantpipe.engine.schedules import build_schedule
    from giantpipe.engine.schedules.actions import Action, Schedule
    from giantpipe.engine.schedules.fill_drain import expected_bubble, fill_drain
    from giantpipe.engine.spec import PipelineSpec
    from giantpipe.engine.stats import StepStats

# Name -> the module that defines it, imported on first use: ``giantpipe.engine.spec`` (which
# the config's schema reads its defaults from) then loads without torch.
_HOMES = {
    "Action": "schedules.actions",
    "CaptureError": "capture",
    "DeferredBatchNorm": "batchnorm",
    "GPipe": "gpipe",
    "PipelineError": "failures",
    "PipelineSpec": "spec",
    "PipelineTimeout": "failures",
    "Schedule": "schedules.actions",
    "StepStats": "stats",
    "build_schedule": "schedules",
    "convert_deferred_batch_norm": "batchnorm",
    "expected_bubble": "schedules.fill_drain",
    "failed_action": "failures",
    "fill_drain": "schedules.fill_drain",
    "is_recomputing": "recompute",
    "pipeline_grad_scaler": "fp16",
    "rng_context": "rng",
    "sequentialize": "capture",
    "verify_module": "partition",
}

__all__ = [
    "Action",
    "CaptureError",
    "DeferredBatchNorm",
    "GPipe",
    "PipelineError",
    "PipelineSpec",
    "PipelineTimeout",
    "Schedule",
    "StepStats",
    "build_schedule",
    "convert_deferred_batch_norm",
    "expected_bubble",
    "failed_action",
    "fill_drain",
    "is_recomputing",
    "pipeline_grad_scaler",
    "rng_context",
    "sequentialize",
    "verify_module",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'giantpipe.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"giantpipe.engine.{_HOMES[name]}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
