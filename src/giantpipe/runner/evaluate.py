"""Evaluation: the pipeline's forward over the eval batches, no gradients, eval mode.

Example::

    figures = evaluate(pipe, bundle, max_batches=None, precision="fp32", devices=devices)
    figures   # {"loss": 0.41, "accuracy": 0.87}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from giantpipe.data.bundle import DataBundle, batch_size
from giantpipe.runner.losses import LossFn, build_loss, count_correct, count_top_k
from giantpipe.runner.step import autocast, to_device


@dataclass
class Tally:
    """Running sums over evaluation batches."""

    loss_sum: float = 0.0
    weight: float = 0.0
    correct: int = 0
    counted: int = 0
    correct_top5: int = 0


def _add_batch(
    tally: Tally, output: Tensor, targets: Tensor, bundle: DataBundle, loss_fn: LossFn
) -> None:
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


@torch.no_grad()
def evaluate(
    pipe: nn.Module,
    bundle: DataBundle,
    max_batches: int | None,
    precision: str,
    devices: Sequence[str],
) -> dict[str, float]:
    """Loss (without label smoothing: the plain NLL or MSE) and the bundle's metric
    (``accuracy``; for ``top5`` both ``accuracy`` and ``top5``)."""
    tally = Tally()
    summed = bundle.loss_normalizer is not None
    loss_fn = build_loss(bundle.loss, 0.0, bundle.ignore_index, summed=summed)
    was_training = pipe.training
    pipe.eval()
    try:
        for index, (inputs, targets) in enumerate(bundle.eval_batches()):
            if max_batches is not None and index >= max_batches:
                break
            with autocast(precision, devices[0]):
                output = pipe(to_device(inputs, devices[0]))
            if not isinstance(output, Tensor) or not isinstance(targets, Tensor):
                raise TypeError("the runner's losses need a tensor output and tensor targets")
            _add_batch(tally, output, targets.to(output.device), bundle, loss_fn)
    finally:
        pipe.train(was_training)
    figures = {"loss": tally.loss_sum / max(tally.weight, 1e-12)}
    if bundle.metric in ("accuracy", "top5"):
        figures["accuracy"] = tally.correct / max(tally.counted, 1)
    if bundle.metric == "top5":
        figures["top5"] = tally.correct_top5 / max(tally.counted, 1)
    return figures
