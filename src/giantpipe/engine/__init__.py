"""The pipeline engine: runs one step of a partitioned ``nn.Sequential``. Imports torch only.

What lives here, one concept per module:

- :mod:`.spec`: a pipeline's shape, :class:`PipelineSpec`, checked once (imports no torch);
- :mod:`.schedules`: schedules as data (Action, Schedule, validation), fill-drain, the 1F1B
  family, and every schedule by name (:func:`build_schedule`);
- :mod:`.partition`: cutting a flat Sequential into stages on devices, tied parameters;
- :mod:`.microbatch`: cutting a batch into micro-batches and gathering it back;
- :mod:`.recompute`: exact re-materialization (the modes, the recompute stop);
- :mod:`.rng`: dropout replayed in re-materialization, a seed per step and micro-batch;
- :mod:`.batchnorm`: deferred BatchNorm, statistics committed once per mini-batch;
- :mod:`.autograd`: where one stage's autograd graph meets the next;
- :mod:`.split_backward`: the backward split in B (input gradient) and W (weight gradient);
- :mod:`.fp16`: fp16 loss scaling, the scale in each micro-batch's gradient, agreed verdicts;
- :mod:`.step_config`: what a step is given (:class:`~.step_config.StepConfig`, the loss);
- :mod:`.executor`: the local executor, a step's actions run by its workers (``StepRun``);
- :mod:`.failures`: where a stage's exception was raised, the engine's own errors;
- :mod:`.mailbox`: how the workers hand each other activations and gradients;
- :mod:`.workers`: the worker threads kept from step to step;
- :mod:`.streams`: each worker's CUDA device and stream;
- :mod:`.profiling`: the executor as torch.profiler sees it;
- :mod:`.stats`: what a step measures (:class:`StepStats`);
- :mod:`.pipe`: the base both pipes share (``Pipe``);
- :mod:`.gpipe`: :class:`GPipe`, a worker thread per device, torchgpipe's door and the step's;
- :mod:`.capture`: any model as a flat Sequential (:func:`sequentialize`, torch.export);
- :mod:`.generate`: generation through either pipe, each stage keeping its key/value caches;
- :mod:`.inference`: a pipe used as its whole model for inference (:class:`~.inference.PipedModel`);
- :mod:`.dist`: ``DistributedPipe``, a process per device (imported only by who needs it).

Nothing here imports Hydra, the runner, ``models`` or the cost model (:mod:`giantpipe.perf`,
which takes a pipe: ``giantpipe.perf.predict.predict(pipe, x, y, loss_fn)``). Anything may
import this package; :mod:`.dist` is imported only by who needs torch.distributed.

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
