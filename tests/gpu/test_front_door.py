"""The front door: ``y = pipe(x); loss = f(y); loss.backward()`` equals the plain model.

torchgpipe's door runs fill-drain (on the schedule's placement), autograd calling back into the
pipeline; the step's loss, gradients, BatchNorm statistics and eval outputs are judged against
the plain model in fp32. A hang (autograd waiting on a stage that never answers) is the test's
timeout, with every thread's stack.
"""

from __future__ import annotations

from contextlib import closing
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.testing.gpu import GpuOptions
from tests.gpu.case import Record, marks, report
from tests.gpu.errors import FP32_CRITERION, fp32_verdict
from tests.gpu.mask_model import Sizes, mask_batch, mask_model, to
from tests.gpu.steps import MODES, SEED, Outcome, eval_outputs, pipe_for, plain_step

pytestmark = marks(60.0)

RUNS = [("gpipe", mode) for mode in MODES] + [
    ("interleaved", "except_last"),
    ("zb-v", "except_last"),
]


def front_door_step(pipe: GPipe, inputs: Any, target: torch.Tensor) -> Outcome:
    """``out = pipe(x); loss = f(out, y); loss.backward()``, then the eval outputs."""
    first = pipe.devices[0]
    torch.manual_seed(SEED)
    out = pipe(to(inputs, first))
    loss = nn.functional.cross_entropy(out, target.to(out.device))
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in pipe.named_parameters() if p.grad is not None}
    buffers = {n: b.cpu() for n, b in pipe.named_buffers()}
    outputs = eval_outputs(pipe, to(inputs, first), first, None).float().cpu()
    return Outcome(loss.detach().cpu(), grads, buffers, outputs)


@cache
def reference(opts: GpuOptions) -> Outcome:
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    return plain_step(model, inputs, target, 2 * opts.workers, [(len(model), opts.device)])


@pytest.mark.parametrize(("schedule", "mode"), RUNS, ids=[f"{s}-{m}" for s, m in RUNS])
def test_the_front_door_equals_the_plain_model(
    schedule: str, mode: str, opts: GpuOptions, record_property: Record
) -> None:
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    with closing(pipe_for(model, opts, schedule, mode)) as pipe:
        ok, measured = fp32_verdict(front_door_step(pipe, inputs, target), reference(opts))
    record_property("note", "The front door always runs fill-drain (on the schedule's placement).")
    report(record_property, f"{schedule} placement / {mode}", ok, measured, FP32_CRITERION)
