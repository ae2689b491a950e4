"""A step's collectives under the pipe's timeout: a sum in place, a sum of one number, every
rank's row of statistics.

Device tensors go to device groups, numbers made on the host to gloo groups; a wait over the
timeout raises ``RankFailure`` naming what was waited for (:mod:`.faults`); the replicas'
gradients are FSDP2's (:mod:`.replicas`). See
docs/engine-internals.md#the-distributed-steps-collectives.

Example::

    tokens = all_reduce_sum(local_tokens, groups.host_replica, 60.0, board, "tokens")
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from giantpipe.engine.distributed.faults import FailureBoard, wait_work

__all__ = ["all_gather_rows", "all_reduce_", "all_reduce_sum"]


def all_reduce_(
    tensor: torch.Tensor, group: Any, timeout: float, board: FailureBoard | None, what: str
) -> torch.Tensor:
    """Sums ``tensor`` in place over ``group``; a wait over ``timeout`` raises RankFailure
    naming ``what`` (e.g. "BatchNorm statistics") and the ranks.

    Example::

        all_reduce_(stats, groups.replica, 60.0, board, "BatchNorm statistics")
    """
    work = dist.all_reduce(tensor, group=group, async_op=True)
    ranks = dist.get_process_group_ranks(group)
    wait_work(work, timeout, f"the all-reduce of {what} over ranks {ranks}", board)
    return tensor


def all_reduce_sum(
    value: float, group: Any, timeout: float, board: FailureBoard | None, what: str
) -> float:
    """Sum of ``value`` over ``group`` (float64, so counts and losses stay exact); a CPU
    tensor, so ``group`` is a host group.

    Example::

        tokens = all_reduce_sum(local_tokens, groups.host_replica, 60.0, board, "tokens")
    """
    total = torch.tensor([value], dtype=torch.float64)
    return float(all_reduce_(total, group, timeout, board, what)[0])


def all_gather_rows(
    row: torch.Tensor, group: Any, ranks: list[int], timeout: float, board: FailureBoard | None
) -> torch.Tensor:
    """Every rank's ``row`` of the step's statistics, stacked in rank order (``ranks`` are
    the group's; with one rank, no collective). ``group`` serves ``row``'s device: a CPU row
    goes to a host group.

    Example::

        table = all_gather_rows(row, groups.host_pipeline, layout.pipeline_ranks, 60.0, board)
    """
    if len(ranks) == 1:
        return row.unsqueeze(0)
    rows = [torch.empty_like(row) for _ in ranks]
    work = dist.all_gather(rows, row, group=group, async_op=True)
    wait_work(work, timeout, f"the all-gather of step statistics over ranks {ranks}", board)
    return torch.stack(rows)
