"""fp16 with a gradient scaler, every schedule: steps, skips and scales as the plain model does.

A normal step (initial scale 2^8): the unscaled gradients against fp32 by the factor rule (no
worse than 1.5x the plain fp16 model's error), the step taken, the scale after ``update()`` the
plain model's. An overflowing one (2^100): the step skipped and the scale halved, as with the
plain model. 2^8 leaves this model's fp16 gradients finite (2^16 overflows the tiny dry-run
model's largest gradient, about 1.0). The pipe's scaler: ``pipe.grad_scaler()``
(torch.amp.GradScaler for GPipe); the plain model's: torch's GradScaler, micro-batch by
micro-batch (:mod:`giantpipe.testing`).
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from torch import nn

from giantpipe.testing.gpu import GpuOptions
from tests.gpu.case import Record, marks, report
from tests.gpu.errors import LOW_CRITERION, LOW_PRECISION_FACTOR, errors, worst_ratio
from tests.gpu.mask_model import Sizes, mask_batch, mask_model, to
from tests.gpu.steps import SEED, Outcome, pipe_for, plain_step, schedules, trained_copy

pytestmark = marks(90.0)

NORMAL, OVERFLOW = 2.0**8, 2.0**100  # initial scales: a step that fits fp16, one that cannot
SCALED_CRITERION = LOW_CRITERION + "; stepped; scale as the plain model's"
OVERFLOW_CRITERION = "both skip the step, scale halved alike"


@dataclass
class ScaledStep:
    """An fp16 step with a gradient scaler: unscaled gradients, whether the optimizer stepped,
    the scale after ``update()``."""

    outcome: Outcome
    stepped: bool
    scale: float


def optimizer_step(
    module: nn.Module, scaler: torch.amp.GradScaler, loss: torch.Tensor
) -> ScaledStep:
    """Reads the unscaled gradients, then ``scaler.step`` an SGD optimizer and ``update``."""
    scale = scaler.get_scale()
    grads = {
        n: p.grad.float().cpu() / scale for n, p in module.named_parameters() if p.grad is not None
    }
    before = [p.detach().clone() for p in module.parameters()]
    scaler.step(torch.optim.SGD(module.parameters(), lr=0.1))
    scaler.update()
    stepped = any(not torch.equal(b, p) for b, p in zip(before, module.parameters()))
    return ScaledStep(Outcome(loss.detach().float().cpu(), grads, {}), stepped, scaler.get_scale())


@cache
def plain_scaled(opts: GpuOptions, init_scale: float) -> ScaledStep:
    """The plain model's fp16 step with torch's GradScaler, micro-batch by micro-batch."""
    device, chunks = opts.device, 2 * opts.workers
    model, (inputs, target) = mask_model(Sizes.of(opts)), mask_batch(Sizes.of(opts))
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)
    whole = [(len(model), device)]
    plain, _, loss_sum = trained_copy(model, inputs, target, chunks, whole, torch.float16, scaler)
    return optimizer_step(plain, scaler, loss_sum)


@cache
def fp32_reference(opts: GpuOptions) -> Outcome:
    """The plain model's fp32 step: its loss and gradients (the unscaled ones are judged)."""
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    ref = plain_step(model, inputs, target, 2 * opts.workers, [(len(model), opts.device)])
    return Outcome(ref.loss, ref.grads, {})


def pipe_scaled(opts: GpuOptions, schedule: str, init_scale: float) -> ScaledStep:
    """The same step through ``pipe.train_step(..., grad_scaler=pipe.grad_scaler())``."""
    model, (inputs, target) = mask_model(Sizes.of(opts)), mask_batch(Sizes.of(opts))
    with closing(pipe_for(model, opts, schedule, "except_last")) as pipe:
        scaler = pipe.grad_scaler(init_scale=init_scale)
        first, last = pipe.devices[0], pipe.devices[-1]
        torch.manual_seed(SEED)
        with torch.autocast(last.type, dtype=torch.float16):
            loss = pipe.train_step(
                to(inputs, first), target.to(last), nn.functional.cross_entropy, grad_scaler=scaler
            )
        return optimizer_step(pipe, scaler, loss)


@pytest.mark.parametrize("schedule", schedules())
def test_a_scaled_step_equals_the_plain_models(
    schedule: str, opts: GpuOptions, record_property: Record
) -> None:
    """The normal step: unscaled gradients by the factor rule, stepped, the plain model's
    scale."""
    got, plain = pipe_scaled(opts, schedule, NORMAL), plain_scaled(opts, NORMAL)
    ref = fp32_reference(opts)
    pipe_errs, plain_errs = errors(got.outcome, ref), errors(plain.outcome, ref)
    name, factor = worst_ratio(pipe_errs, plain_errs)
    same = got.stepped == plain.stepped and got.scale == plain.scale
    ok = factor <= LOW_PRECISION_FACTOR and same and got.stepped
    measured = f"{factor:.2f}x ({name}); stepped {got.stepped}; scale {got.scale:g}"
    note = f"Scaler: pipe.grad_scaler() (torch.amp.GradScaler for GPipe), M={2 * opts.workers}."
    record_property("note", note)
    report(record_property, f"{schedule}: scaled step", ok, measured, SCALED_CRITERION)


@pytest.mark.parametrize("schedule", schedules())
def test_an_overflowing_step_is_skipped_as_the_plain_models(
    schedule: str, opts: GpuOptions, record_property: Record
) -> None:
    """The overflowing step: skipped, and the scale halved as the plain model's."""
    over, plain = pipe_scaled(opts, schedule, OVERFLOW), plain_scaled(opts, OVERFLOW)
    ok = not over.stepped and not plain.stepped and over.scale == plain.scale
    measured = f"stepped {over.stepped}; scale {over.scale:g} (plain {plain.scale:g})"
    report(record_property, f"{schedule}: overflow skipped", ok, measured, OVERFLOW_CRITERION)
