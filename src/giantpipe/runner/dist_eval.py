"""Evaluation under the distributed executor: the pipelined forward, tallied on the last stage.

Every rank runs the same number of forwards (rank 0, which reads the data, says how many);
stage 0's ranks feed their replica's slice of each batch, the last stage's ranks score the
outputs exactly as :func:`giantpipe.runner.evaluate.evaluate` does, and one all-reduce over
the world sums the tallies, so every rank returns the figures of the whole evaluation set.

Example::

    figures = evaluate_distributed(pipe, bundle, max_batches=None, precision="fp32",
                                   device=torch.device("cpu"))    # {"loss": .., "accuracy": ..}
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from giantpipe.data.bundle import Batch, DataBundle
from giantpipe.engine.dist.faults import wait_work
from giantpipe.engine.dist.pipe import DistributedPipe
from giantpipe.runner.dist_build import replica_slice
from giantpipe.runner.evaluate import Tally, _add_batch
from giantpipe.runner.losses import build_loss
from giantpipe.runner.step import autocast, to_device


def _count(batches: Iterable[Batch], limit: int | None) -> int:
    if isinstance(batches, Sized):
        total = len(batches)
        return total if limit is None else min(total, limit)
    return sum(1 for _ in islice(batches, limit))


def _all_sum(pipe: DistributedPipe, values: list[float]) -> list[float]:
    total = torch.tensor(values, dtype=torch.float64)
    work = dist.all_reduce(total, group=pipe.groups.p2p, async_op=True)
    wait_work(work, pipe.timeout, "the all-reduce of the evaluation tallies", pipe.board)
    return total.tolist()


@torch.no_grad()
def evaluate_distributed(
    pipe: DistributedPipe,
    bundle: DataBundle,
    max_batches: int | None,
    precision: str,
    device: torch.device,
) -> dict[str, float]:
    """Loss (no label smoothing) and the bundle's metric over the eval batches; every rank."""
    summed = bundle.loss_normalizer is not None
    loss_fn = build_loss(bundle.loss, 0.0, bundle.ignore_index, summed=summed)
    feeds = pipe.needs_inputs or pipe.needs_targets
    count = [_count(bundle.eval_batches(), max_batches) if pipe.layout.rank == 0 else 0]
    dist.broadcast_object_list(count, src=0, group=pipe.groups.p2p)
    stream: Iterator[Batch] | None = iter(bundle.eval_batches()) if feeds else None
    r, replicas = pipe.replica, pipe.replicas
    tally = Tally()
    was_training = pipe.training
    pipe.eval()
    try:
        for _ in range(int(count[0])):
            batch = next(stream) if stream is not None else None
            inputs: Any = None
            if batch is not None and pipe.needs_inputs:
                inputs = to_device(replica_slice(batch[0], r, replicas), device)
            with autocast(precision, str(device)):
                output = pipe(inputs)
            if batch is not None and pipe.needs_targets:
                targets = replica_slice(batch[1], r, replicas)
                if not isinstance(output, Tensor) or not isinstance(targets, Tensor):
                    raise TypeError("the runner's losses need a tensor output and tensor targets")
                _add_batch(tally, output, targets.to(output.device), bundle, loss_fn)
    finally:
        pipe.train(was_training)
    loss_sum, weight, correct, counted, top5 = _all_sum(
        pipe,
        [tally.loss_sum, tally.weight, tally.correct, tally.counted, tally.correct_top5],
    )
    figures = {"loss": loss_sum / max(weight, 1e-12)}
    if bundle.metric in ("accuracy", "top5"):
        figures["accuracy"] = correct / max(counted, 1)
    if bundle.metric == "top5":
        figures["top5"] = top5 / max(counted, 1)
    return figures
