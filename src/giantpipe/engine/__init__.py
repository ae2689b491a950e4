"""The pipeline engine: runs one step of a partitioned ``nn.Sequential``. Imports torch only.

What lives here, one concept per module:

- schedules as data (:mod:`.schedule`: Action, Schedule, validation; :mod:`.schedules`: 1F1B,
  interleaved, zero bubble and the registry by name);
- cutting the model and the batch (:mod:`.partition`, :mod:`.microbatch`);
- exact re-materialization (:mod:`.recompute`), dropout replay (:mod:`.rng`), deferred
  BatchNorm (:mod:`.batchnorm`), where stages' autograd graphs meet and the B/W split
  (:mod:`.autograd`);
- the local executor (:mod:`.executor`: a step's actions; :mod:`.workers`: its threads and
  mailbox; :mod:`.streams`: each worker's CUDA device and stream) and what it measures
  (:mod:`.stats`);
- fp16 loss scaling handed to the step door (:func:`pipeline_grad_scaler`, :mod:`.base`);
- any model as a flat Sequential (:mod:`.capture`: ``sequentialize``, torch.export cut at
  named submodules);
- the two pipes: :class:`GPipe` (:mod:`.gpipe`, a worker thread per device) and
  ``DistributedPipe`` (:mod:`.dist`, a process per device), which share :mod:`.base`.

Nothing here imports Hydra, the runner, ``models`` or the cost model (:mod:`giantpipe.perf`),
but for ``GPipe.predict``, which imports ``giantpipe.perf.predict`` when called. Anything may
import this package; :mod:`.dist` is imported only by who needs torch.distributed.

Example::

    from giantpipe.engine import GPipe

    pipe = GPipe(model, balance=[4, 4], devices=["cpu", "cpu"], chunks=8)
    loss = pipe.train_step(x, y, torch.nn.functional.cross_entropy)
    print(pipe.last_stats)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from giantpipe.engine.base import pipeline_grad_scaler
    from giantpipe.engine.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
    from giantpipe.engine.capture import CaptureError, sequentialize
    from giantpipe.engine.gpipe import GPipe
    from giantpipe.engine.partition import verify_module
    from giantpipe.engine.recompute import is_recomputing
    from giantpipe.engine.rng import rng_context
    from giantpipe.engine.schedule import Action, Schedule, expected_bubble, gpipe
    from giantpipe.engine.schedules import build_schedule
    from giantpipe.engine.spec import PipelineSpec
    from giantpipe.engine.stats import StepStats
    from giantpipe.engine.workers import PipelineError, PipelineTimeout, failed_action

# Name -> the module that defines it, imported on first use: ``giantpipe.engine.spec`` (which
# the config's schema reads its defaults from) then loads without torch.
_HOMES = {
    "Action": "schedule",
    "CaptureError": "capture",
    "DeferredBatchNorm": "batchnorm",
    "GPipe": "gpipe",
    "PipelineError": "workers",
    "PipelineSpec": "spec",
    "PipelineTimeout": "workers",
    "Schedule": "schedule",
    "StepStats": "stats",
    "build_schedule": "schedules",
    "convert_deferred_batch_norm": "batchnorm",
    "expected_bubble": "schedule",
    "failed_action": "workers",
    "gpipe": "schedule",
    "is_recomputing": "recompute",
    "pipeline_grad_scaler": "base",
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
    "gpipe",
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


class _Package(types.ModuleType):
    """This package. Importing the submodule ``giantpipe.engine.gpipe`` binds it here as
    ``gpipe``, which would hide the exported fill-drain builder of that name (the eager imports
    bound the function last): the package keeps the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "gpipe" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
