"""Transparency: every schedule x re-materialization mode equals the plain model, in fp32 and in
bf16, and values and gradients crossing between the host and a GPU.

Each test runs K stages (``opts.workers``), M = 2K, V=2 for interleaved and zb-v, on the mask
model (BatchNorm deferred, dropout 0.1, an int64 mask riding along): the step's loss, every
gradient, the deferred BatchNorm statistics and the eval outputs against the plain model. fp32:
every tensor within float noise; bf16 (autocast around train_step, the plain model under the
same autocast): the pipe's error against fp32 no worse than 1.5x the plain bf16 model's.
"""

from __future__ import annotations

from contextlib import closing
from functools import cache

import pytest
import torch

from giantpipe.perf.balance import even_balance
from giantpipe.testing.gpu import CUDA_ONLY, GpuOptions
from tests.gpu.case import Record, marks, not_here, report
from tests.gpu.errors import (
    FP32_CRITERION,
    LOW_CRITERION,
    fp32_verdict,
    low_precision_verdict,
)
from tests.gpu.mask_model import Sizes, mask_batch, mask_model
from tests.gpu.steps import MODES, Outcome, build_pipe, pipe_for, pipe_step, plain_step, schedules

pytestmark = marks(120.0)

CONFIGURATIONS = [(schedule, mode) for schedule in schedules() for mode in MODES]
IDS = [f"{schedule}-{mode}" for schedule, mode in CONFIGURATIONS]


@cache
def references(opts: GpuOptions, dtype: torch.dtype | None) -> tuple[Outcome, Outcome | None]:
    """The plain model's step in fp32 and, for a low precision, in it too (once per run)."""
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    whole = [(len(model), opts.device)]
    ref = plain_step(model, inputs, target, 2 * opts.workers, whole)
    low = (
        None if dtype is None else plain_step(model, inputs, target, 2 * opts.workers, whole, dtype)
    )
    return ref, low


def note(opts: GpuOptions) -> str:
    """What every row of these tests ran on."""
    sizes, where = Sizes.of(opts), ", ".join(str(d) for d in opts.devices())
    return (
        f"K={opts.workers} on {where}, M={2 * opts.workers}, {sizes.blocks + 2} layers (mask "
        f"model: BatchNorm deferred, dropout 0.1, int64 mask), batch {sizes.batch}; V=2 for "
        "interleaved, zb-v."
    )


def pipelined(opts: GpuOptions, schedule: str, mode: str, dtype: torch.dtype | None) -> Outcome:
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    with closing(pipe_for(model, opts, schedule, mode)) as pipe:
        return pipe_step(pipe, inputs, target, dtype)


@pytest.mark.parametrize(("schedule", "mode"), CONFIGURATIONS, ids=IDS)
def test_fp32_equals_the_plain_model(
    schedule: str, mode: str, opts: GpuOptions, record_property: Record
) -> None:
    ref, _ = references(opts, None)
    ok, measured = fp32_verdict(pipelined(opts, schedule, mode, None), ref)
    record_property("note", note(opts))
    report(record_property, f"{schedule} / {mode}", ok, measured, FP32_CRITERION)


def test_fp32_stages_on_the_host_and_a_gpu(opts: GpuOptions, record_property: Record) -> None:
    """Stage 0 on the host, stage 1 on the GPU: values and gradients cross between devices (on
    one GPU, the only copy between devices a pipeline can make)."""
    check = "gpipe / except_last, stages on cpu + cuda:0"
    criterion = "host<->device copies between stages: " + FP32_CRITERION
    if opts.dry:
        not_here(record_property, CUDA_ONLY, check, "-", criterion)
    sizes = Sizes.of(opts)
    model, (inputs, target) = mask_model(sizes), mask_batch(sizes)
    chunks, balance = 2 * opts.workers, even_balance(len(model), 2)
    devices = [torch.device("cpu"), torch.device("cuda", 0)]
    ref = plain_step(model, inputs, target, chunks, list(zip(balance, devices)))
    pipe = build_pipe(
        model, opts, balance, chunks=chunks, checkpoint="except_last", devices=devices
    )
    with closing(pipe):
        ok, measured = fp32_verdict(pipe_step(pipe, inputs, target), ref)
    report(record_property, check, ok, measured, criterion)


@pytest.mark.parametrize(("schedule", "mode"), CONFIGURATIONS, ids=IDS)
def test_bf16_is_no_worse_than_the_plain_model(
    schedule: str, mode: str, opts: GpuOptions, record_property: Record
) -> None:
    ref, low = references(opts, torch.bfloat16)
    assert low is not None
    got = pipelined(opts, schedule, mode, torch.bfloat16)
    ok, measured = low_precision_verdict(got, ref, low)
    record_property("note", note(opts))
    record_property("note", "bf16: autocast around train_step; plain = the same autocast step.")
    report(record_property, f"{schedule} / {mode}", ok, measured, LOW_CRITERION)
