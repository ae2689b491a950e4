"""No host synchronisation inside a step: a step must never wait for the GPU.

Every way of stepping a pipe (train_step under every schedule, the front door, an fp16 step with
a gradient scaler) runs once to warm up, then once watched: on CUDA under
``torch.cuda.set_sync_debug_mode('warn')`` (a synchronising call anywhere in the step fails
it); on CPU stand-ins the host reads (``.item()``, ``.cpu()``, ...) are listed, not judged:
every tensor is on the host, so no call there is a synchronisation, but the reads listed would
be one if their tensor lived on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.testing.gpu import CUDA_ONLY, GpuOptions
from tests.gpu.case import Record, marks, not_here, report
from tests.gpu.mask_model import Sizes, mask_batch, mask_model, to
from tests.gpu.steps import SEED, pipe_for, schedules
from tests.gpu.sync import cuda_syncs, host_reads, summarise

pytestmark = marks(90.0)

CRITERION = "no synchronising CUDA call (sync debug mode 'warn')"
DOOR, SCALED = "front door (forward + backward)", "train_step gpipe, fp16 + grad_scaler"
STEPS = [
    *((f"train_step {name}", name) for name in schedules()),
    (DOOR, "gpipe"),
    (SCALED, "gpipe"),
]
"""(label, schedule): every way of stepping a pipe."""


def step_of(label: str, pipe: GPipe, x: Any, y: torch.Tensor) -> Callable[[], Any]:
    """The step ``label`` names, on ``pipe``."""
    if label == DOOR:
        return lambda: nn.functional.cross_entropy(pipe(x), y).backward()
    if label == SCALED:
        scaler = pipe.grad_scaler()

        def scaled() -> Any:
            with torch.autocast(pipe.devices[-1].type, dtype=torch.float16):
                return pipe.train_step(x, y, nn.functional.cross_entropy, grad_scaler=scaler)

        return scaled
    return lambda: pipe.train_step(x, y, nn.functional.cross_entropy)


@pytest.mark.parametrize(("label", "schedule"), STEPS, ids=[label for label, _ in STEPS])
def test_no_host_synchronisation_inside_a_step(
    label: str, schedule: str, opts: GpuOptions, record_property: Record
) -> None:
    model, (inputs, target) = mask_model(Sizes.of(opts)), mask_batch(Sizes.of(opts))
    with closing(pipe_for(model, opts, schedule, "except_last")) as pipe:
        x, y = to(inputs, pipe.devices[0]), target.to(pipe.devices[-1])  # zb-v ends on worker 0
        step = step_of(label, pipe, x, y)
        torch.manual_seed(SEED)
        step()  # warm-up: first-use initialisations (handles, streams, events) may sync
        torch.manual_seed(SEED)
        with host_reads() if opts.dry else cuda_syncs() as seen:
            step()
    if opts.dry:
        not_here(record_property, CUDA_ONLY, label, "host reads: " + summarise(seen), CRITERION)
    report(record_property, label, not seen, summarise(seen), CRITERION)
