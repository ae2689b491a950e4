"""What one pipeline step is given: the stages, their devices, the loss; and how it fails.

Both executors (:mod:`giantpipe.engine.executor` in one process, :mod:`giantpipe.engine.dist.pipe`
across processes) run a :class:`~giantpipe.engine.executor.StepRun` from a :class:`StepConfig`.

Example::

    spec = LossSpec(nn.functional.cross_entropy, micro_targets, scales=[0.25] * 4)
    config = StepConfig(stages, devices, checkpoint_stop=3, grad_enabled=True, seed=7, loss=spec)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from giantpipe.engine.microbatch import TensorOrTensors

LossFn = Callable[[Any, Any], torch.Tensor]


class PipelineError(RuntimeError):
    """An action of the pipeline failed; ``stage`` and ``microbatch`` say which."""

    def __init__(self, stage: int, microbatch: int, device: torch.device, cause: BaseException):
        self.stage, self.microbatch, self.device = stage, microbatch, device
        super().__init__(
            f"stage {stage} (device {device}) failed on micro-batch {microbatch}: "
            f"{type(cause).__name__}: {cause}"
        )


@dataclass
class LossSpec:
    """The step API's loss: ``loss_fn(output_m, target_m) * scale[m]`` on the last stage."""

    fn: LossFn
    targets: list[TensorOrTensors]
    scales: list[float]


@dataclass
class StepConfig:
    """Everything a step needs that the workers only read."""

    stages: Sequence[nn.Sequential]
    devices: Sequence[torch.device]
    checkpoint_stop: int
    grad_enabled: bool
    seed: int
    autocast: list[tuple[str, torch.dtype]] = field(default_factory=list)
    loss: LossSpec | None = None
    threads_per_worker: int | None = None
    timeout: float = 300.0
    placement: Sequence[int] | None = None  # worker of each stage; None: one stage per worker


def autocast_state(devices: Sequence[torch.device]) -> list[tuple[str, torch.dtype]]:
    """Autocast settings of the caller, for each device type the pipeline uses."""
    state = []
    for device_type in sorted({d.type for d in devices}):
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, torch.get_autocast_dtype(device_type)))
    return state
