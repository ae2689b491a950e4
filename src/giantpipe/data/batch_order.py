"""The seeded batch order the in-memory data options share: an epoch's permutation, endless
shuffled batches from a position, and the evaluation set in order.

Training batches are a pure function of (seed, position), so a resumed run sees the batches an
uninterrupted one would have seen.

Example::

    from giantpipe.data.batch_order import sequential_batches, shuffled_batches

    stream = shuffled_batches(x, y, batch_size=64, seed=0, position=10)   # from batch 10 on
    eval_set = sequential_batches(x_eval, y_eval, batch_size=64)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from giantpipe.data.bundle import Batch


def epoch_order(size: int, seed: int, epoch: int) -> Tensor:
    """The shuffled sample order of one epoch: a function of (seed, epoch) only.

    Example::

        epoch_order(10, seed=0, epoch=3)   # the same permutation every time
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def shuffled_batches(
    inputs: Tensor, targets: Tensor, batch_size: int, seed: int, position: int
) -> Iterator[Batch]:
    """Endless shuffled batches (last partial batch of an epoch dropped), from batch ``position``.

    Batch ``p`` is batch ``p % per_epoch`` of epoch ``p // per_epoch``, so a resumed stream equals
    the uninterrupted one, and two consecutive batches of size B equal one batch of size 2B.

    Example::

        stream = shuffled_batches(x, y, batch_size=64, seed=0, position=10)
    """
    per_epoch = len(inputs) // batch_size
    while True:
        epoch, index = divmod(position, per_epoch)
        order = epoch_order(len(inputs), seed, epoch)
        while index < per_epoch:
            take = order[index * batch_size : (index + 1) * batch_size]
            yield inputs[take], targets[take]
            index += 1
            position += 1


def sequential_batches(inputs: Tensor, targets: Tensor, batch_size: int) -> list[Batch]:
    """The data in order, in batches of ``batch_size`` (the last one may be smaller)."""
    return [
        (inputs[i : i + batch_size], targets[i : i + batch_size])
        for i in range(0, len(inputs), batch_size)
    ]
