"""Loss functions and the accuracy metric, as the data bundle asks for them.

The engine calls ``loss_fn(output_micro_batch, target_micro_batch)``. Without a loss normalizer it
must return the MEAN over the micro-batch (the engine weights micro-batches by size); with one it
must return the SUM (the engine divides by the normalizer, e.g. the batch's real token count).

Example::

    loss_fn = build_loss("cross_entropy", label_smoothing=0.1, ignore_index=None, summed=False)
    loss = loss_fn(torch.randn(4, 10), torch.tensor([1, 2, 3, 4]))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

LossFn = Callable[[Tensor, Tensor], Tensor]
_TORCH_NO_IGNORE = -100  # torch's default ignore_index, matching no real class index


def build_loss(kind: str, label_smoothing: float, ignore_index: int | None, summed: bool) -> LossFn:
    """Cross-entropy over the last dimension (any leading shape), or mean squared error."""
    reduction = "sum" if summed else "mean"
    if kind == "mse":
        return lambda output, target: F.mse_loss(
            output.float(), target.float(), reduction=reduction
        )

    ignore = _TORCH_NO_IGNORE if ignore_index is None else ignore_index

    def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(
            output.float().reshape(-1, output.shape[-1]),
            target.reshape(-1),
            reduction=reduction,
            label_smoothing=label_smoothing,
            ignore_index=ignore,
        )

    return cross_entropy


def count_correct(output: Tensor, target: Tensor, ignore_index: int | None) -> tuple[int, int]:
    """(correct predictions, counted targets) for top-1 accuracy, skipping ``ignore_index``.

    Example::

        count_correct(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]), None)  # (1, 2)
    """
    predicted = output.argmax(dim=-1).to(target.device)
    keep = torch.ones_like(target, dtype=torch.bool)
    if ignore_index is not None:
        keep = target != ignore_index
    correct = ((predicted == target) & keep).sum().item()
    return int(correct), int(keep.sum().item())


def count_top_k(output: Tensor, target: Tensor, k: int, ignore_index: int | None) -> int:
    """Targets among the ``k`` highest outputs (k capped at the number of classes), skipping
    ``ignore_index``: the numerator of top-k accuracy (the denominator is count_correct's).

    Example::

        count_top_k(torch.tensor([[0.1, 0.5, 0.4], [0.8, 0.1, 0.1]]), torch.tensor([2, 1]), 2, None)
        # 1: class 2 is in the first row's top 2, class 1 not in the second's
    """
    k = min(k, output.shape[-1])
    top = output.topk(k, dim=-1).indices.to(target.device)
    hit = (top == target.unsqueeze(-1)).any(dim=-1)
    if ignore_index is not None:
        hit &= target != ignore_index
    return int(hit.sum().item())
