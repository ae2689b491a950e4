"""Evaluation: the pipeline's forward over the eval batches, no gradients, eval mode.

One evaluation for both executors: every process runs the same forwards and returns the figures
of the whole evaluation set; the data's whole-model figures run through the pipe's stages
(:func:`whole_model_figures`): docs/architecture.md#one-runner-for-both-executors.

Example::

    figures = evaluate(pipe, bundle, max_batches=None, precision="fp32", devices=devices)
    figures   # {"loss": 0.41, "accuracy": 0.87}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
from torch import Tensor, nn

from giantpipe.data.bundle import Batch, DataBundle, Tensors, batch_size
from giantpipe.engine.generate import evaluating
from giantpipe.engine.inference import PipedModel
from giantpipe.engine.pipe import Pipe
from giantpipe.runner.losses import LossFn, build_loss, count_correct, count_top_k
from giantpipe.runner.step import autocast, replica_slice, to_device
from giantpipe.runner.world import World


@dataclass
class Tally:
    """Running sums over evaluation batches."""

    loss_sum: float = 0.0
    weight: float = 0.0
    correct: int = 0
    counted: int = 0
    correct_top5: int = 0

    def as_list(self) -> list[float]:
        return [self.loss_sum, self.weight, self.correct, self.counted, self.correct_top5]


def add_batch(
    tally: Tally, output: Tensor, targets: Tensor, bundle: DataBundle, loss_fn: LossFn
) -> None:
    """Scores one batch into ``tally``."""
    normalizer = bundle.loss_normalizer
    loss = float(loss_fn(output, targets))
    if normalizer is not None:  # a summed loss over the batch's real tokens
        tally.loss_sum, tally.weight = tally.loss_sum + loss, tally.weight + normalizer(targets)
    else:  # a mean loss, re-weighted by batch size so an uneven last batch counts fairly
        size = batch_size(targets)
        tally.loss_sum, tally.weight = tally.loss_sum + loss * size, tally.weight + size
    if bundle.metric in ("accuracy", "top5"):
        correct, counted = count_correct(output, targets, bundle.ignore_index)
        tally.correct, tally.counted = tally.correct + correct, tally.counted + counted
    if bundle.metric == "top5":
        tally.correct_top5 += count_top_k(output, targets, 5, bundle.ignore_index)


def _count(batches: Iterable[Batch], limit: int | None) -> int:
    if isinstance(batches, Sized):
        total = len(batches)
        return total if limit is None else min(total, limit)
    return sum(1 for _ in islice(batches, limit))


def eval_stream(
    bundle: DataBundle, max_batches: int | None, wanted: bool, world: World
) -> Iterator[Batch | None]:
    """The eval batches this process takes part in: real ones where it feeds the pipe, ``None``
    elsewhere, as many everywhere as rank 0 counts."""
    if world.size == 1:
        yield from islice(bundle.eval_batches(), max_batches)
        return
    count = world.from_rank0(_count(bundle.eval_batches(), max_batches) if world.rank == 0 else 0)
    stream = iter(bundle.eval_batches()) if wanted else None
    for _ in range(count):
        yield next(stream) if stream is not None else None


def _figures(total: list[float], metric: str | None) -> dict[str, float]:
    loss_sum, weight, correct, counted, top5 = total
    figures = {"loss": loss_sum / max(weight, 1e-12)}
    if metric in ("accuracy", "top5"):
        figures["accuracy"] = correct / max(counted, 1)
    if metric == "top5":
        figures["top5"] = top5 / max(counted, 1)
    return figures


@torch.no_grad()
def evaluate(
    pipe: Pipe | nn.Module,
    bundle: DataBundle,
    max_batches: int | None,
    precision: str,
    devices: Sequence[str],
    world: World | None = None,
) -> dict[str, float]:
    """Loss (without label smoothing: the plain NLL or MSE) and the bundle's metric
    (``accuracy``; for ``top5`` both ``accuracy`` and ``top5``), on every process; for a loss
    per token (:func:`per_token`) also ``perplexity``, exp(loss).

    ``devices``: inputs go to the first, outputs are scored where they come out.
    """
    world = world or World()
    tally = Tally()
    summed = bundle.loss_normalizer is not None
    loss_fn = build_loss(bundle.loss, 0.0, bundle.ignore_index, summed=summed)
    inputs_wanted = getattr(pipe, "needs_inputs", True)  # a plain module evaluates too
    targets_wanted = getattr(pipe, "needs_targets", True)
    r, replicas = getattr(pipe, "replica", 0), getattr(pipe, "replicas", 1)
    with evaluating(pipe):  # each module back in the mode it was in (a frozen one stays)
        for batch in eval_stream(bundle, max_batches, inputs_wanted or targets_wanted, world):
            inputs: Any = None
            if batch is not None and inputs_wanted:
                inputs = to_device(even_share(batch[0], r, replicas), devices[0])
            with autocast(precision, devices[0]):
                output = pipe(inputs)
            if batch is not None and targets_wanted:
                targets = replica_slice(batch[1], r, replicas)
                if not isinstance(output, Tensor) or not isinstance(targets, Tensor):
                    raise TypeError("the runner's losses need a tensor output and tensor targets")
                output = output[: batch_size(targets)]  # the rows even_share added go
                if batch_size(targets) > 0:  # a replica's share of a short last batch may be none
                    add_batch(tally, output, targets.to(output.device), bundle, loss_fn)
    figures = _figures(world.sum(tally.as_list()), bundle.metric)
    if per_token(bundle):
        figures["perplexity"] = math.exp(min(figures["loss"], 80.0))  # exp(mean token NLL)
    return figures


def even_share(tensors: Tensors, replica: int, replicas: int) -> Tensors:
    """Replica ``replica``'s share of an evaluation batch (:func:`replica_slice`), made up to
    the largest share with the batch's first rows, so that every replica's forward runs the
    same micro-batches: with FSDP2's ``full`` each gathers its layers per micro-batch, a
    collective of the replicas. The rows added are scored nowhere.

    >>> [even_share(torch.arange(5), r, 2).tolist() for r in (0, 1)]
    [[0, 1, 2], [3, 4, 0]]
    """
    if replicas == 1:
        return tensors
    whole = batch_size(tensors)
    rows = -(-whole // replicas)  # the first shares of tensor_split's are the largest

    def padded(t: Tensor) -> Tensor:
        share = torch.tensor_split(t, replicas)[replica]
        return torch.cat([share, t[: rows - share.shape[0]]])

    return tuple(padded(t) for t in tensors) if isinstance(tensors, tuple) else padded(tensors)


def per_token(bundle: DataBundle) -> bool:
    """Whether the loss is a mean cross-entropy per token (language models, translation), of
    which perplexity is the exponential."""
    return bundle.loss == "cross_entropy" and bundle.tokens_per_batch is not None


def whole_model_figures(pipe: Pipe, bundle: DataBundle, world: World) -> dict[str, float | str]:
    """The data's own evaluation of the whole model (e.g. BLEU), on every process.

    The hook runs on every process with the pipe as its whole model
    (:class:`~giantpipe.engine.inference.PipedModel`: a forward through the stages whose
    outputs reach every process, generation with each stage's caches, any schedule); each
    process holds only its stages throughout. Rank 0's figures reach every process.

    Example::

        whole_model_figures(pipe, bundle, world)   # {"bleu": 12.3, "bleu/en-xa": 15.1, ...}
    """
    hook = bundle.evaluate_model
    if hook is None:
        return {}
    figures: dict[str, float | str] = world.from_rank0(hook(PipedModel(pipe)))
    return figures
