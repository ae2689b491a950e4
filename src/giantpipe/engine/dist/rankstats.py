"""The loss and statistics of a distributed step: one all-gather over the pipeline.

Each rank contributes one row, ``[loss, wall, span, busy, peak]``; after the all-gather every
rank holds the whole table, so ``train_step`` returns the same loss everywhere and
``last_stats`` (per worker, as GPipe's) is the same on every rank::

             loss    wall   span   busy   peak (bytes)
    rank 0 | 0      0.61   0.60   0.52   3.1e7        <- stage 0: no loss
    rank 1 | 2.3071 0.61   0.58   0.53   2.9e7        <- last stage: the global loss

Example::

    loss, stats = gather_step(run, started, local_loss, layout, plan, device, group, 60.0, board)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.engine.executor import StepRun
from giantpipe.engine.dist.faults import FailureBoard, wait_work
from giantpipe.engine.dist.layout import Layout
from giantpipe.engine.stats import device_peak
from giantpipe.engine.schedule import Schedule, expected_bubble
from giantpipe.engine.stats import StepStats


def all_reduce_sum(
    value: float, group: Any, timeout: float, board: FailureBoard | None, what: str
) -> float:
    """Sum of ``value`` over ``group`` (float64, so counts and losses stay exact)."""
    total = torch.tensor([value], dtype=torch.float64)
    work = dist.all_reduce(total, group=group, async_op=True)
    ranks = dist.get_process_group_ranks(group)
    wait_work(work, timeout, f"the all-reduce of the {what} over ranks {ranks}", board)
    return float(total[0])


def gather_step(
    run: StepRun,
    started: float,
    loss: float,
    layout: Layout,
    plan: Schedule,
    device: torch.device,
    group: Any,
    timeout: float,
    board: FailureBoard | None,
) -> tuple[torch.Tensor, StepStats]:
    """The last stage's loss and every worker's statistics, on every rank of the pipeline.

    Busy time sums the worker's stages; peak memory is its saved activations (CPU) or the
    allocator's peak (CUDA).
    """
    on_cuda = device.type == "cuda"
    peak = device_peak(device) if on_cuda else run.worker_peaks[layout.worker]
    busy = sum(run.busy[s] for s in layout.local_stages)
    wall = time.perf_counter() - started
    row = torch.tensor([loss, wall, run.span, busy, peak], dtype=torch.float64)
    rows = [row]
    if layout.workers > 1:
        rows = [torch.empty_like(row) for _ in range(layout.workers)]
        work = dist.all_gather(rows, row, group=group, async_op=True)
        what = f"the all-gather of step statistics over ranks {layout.pipeline_ranks}"
        wait_work(work, timeout, what, board)
    table = torch.stack(rows)
    stats = StepStats.from_timings(
        wall=float(table[:, 1].max()),
        span=float(table[:, 2].max()),
        busy=table[:, 3].tolist(),
        peaks=[int(p) for p in table[:, 4].tolist()],
        num_microbatches=plan.num_microbatches,
        memory_kind="cuda_allocator" if on_cuda else "saved_activations",
    )
    bubble = expected_bubble(layout.workers, plan.num_microbatches, plan.virtual_stages)
    stats = dataclasses.replace(stats, expected_bubble=bubble)
    return table[plan.placement[-1], 0].to(torch.float32), stats
