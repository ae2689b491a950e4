"""What a step is given: the stages, their devices, the loss, the recompute stop, the autocast
state (:class:`StepConfig`), all that the executor's workers read.

Both pipes build it (``Pipe.step_config``, :mod:`giantpipe.engine.pipe`); the executor
(:class:`~giantpipe.engine.executor.StepRun`) and the cost model's replays
(:mod:`giantpipe.perf`) run it.

Example::

    spec = LossSpec(nn.functional.cross_entropy, micro_targets, scales=[0.25] * 4)
    config = StepConfig(stages, devices, recompute_stop=3, grad_enabled=True, seed=7, loss=spec)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from giantpipe.engine.microbatch import TensorOrTensors
from giantpipe.engine.spec import DEFAULT_TIMEOUT

__all__ = ["LossFn", "LossSpec", "StepConfig", "autocast_state"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class LossSpec:
    """The step API's loss: ``loss_fn(output_m, target_m) * scale[m]`` on the last stage."""

    fn: LossFn
    targets: list[TensorOrTensors]
    scales: list[float]
    loss_scale: torch.Tensor | None = None
    """A gradient scaler's scale (fp16), on the last stage's device: every micro-batch's
    backward is that of its loss times it (:func:`~giantpipe.engine.fp16.scale_gradient`);
    the losses kept are unscaled."""


@dataclass
class StepConfig:
    """Everything a step needs that the workers only read."""

    stages: Sequence[nn.Module]
    devices: Sequence[torch.device]
    recompute_stop: int  # micro-batches m < recompute_stop are re-materialized in backward
    grad_enabled: bool
    seed: int
    autocast: list[tuple[str, torch.dtype]] = field(default_factory=list)
    loss: LossSpec | None = None
    threads_per_worker: int | None = None
    timeout: float = DEFAULT_TIMEOUT
    placement: Sequence[int] | None = None  # worker of each stage; None: one stage per worker


def autocast_state(devices: Sequence[torch.device]) -> list[tuple[str, torch.dtype]]:
    """Autocast settings of the caller, for each device type the pipeline uses; the workers
    enter them again (a new thread starts with autocast off).

    Example::

        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_state([torch.device("cpu")])   # [("cpu", torch.bfloat16)]
    """
    state = []
    for device_type in sorted({d.type for d in devices}):
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, torch.get_autocast_dtype(device_type)))
    return state
