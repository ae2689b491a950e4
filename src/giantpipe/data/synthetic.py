"""The ``data=synthetic`` option: generated classification data for quick starts, tests and
throughput tables.

Standard normal vectors labelled by a fixed random "teacher" network (tanh hidden layer, argmax of
noisy logits), so a small MLP learns them and the loss clearly falls from ln(classes). Fields:
``SyntheticDataConfig`` (:mod:`giantpipe.data.options`).

Example::

    from giantpipe.data.synthetic import classification

    bundle = classification(features=16, classes=8, train_size=4096, batch_size=64)
    inputs, targets = next(bundle.train_batches(seed=0, position=0))   # (64, 16), (64,)
"""

from __future__ import annotations

import torch
from torch import Tensor

from giantpipe.data.batch_order import sequential_batches, shuffled_batches
from giantpipe.data.bundle import DataBundle


def make_classification(
    size: int, features: int, classes: int, noise: float, seed: int, split: int = 0
) -> tuple[Tensor, Tensor]:
    """``size`` samples of split ``split`` (0 train, 1 eval) labelled by the teacher of ``seed``.

    Example::

        x, y = make_classification(100, features=4, classes=3, noise=0.1, seed=0, split=1)
    """
    teacher = torch.Generator().manual_seed(seed)
    hidden = torch.randn(features, features, generator=teacher) / features**0.5
    head = torch.randn(features, classes, generator=teacher)
    # Each split draws its inputs from its own stream: train and eval share the teacher only.
    samples = torch.Generator().manual_seed(seed * 1_000_003 + split + 1)
    x = torch.randn(size, features, generator=samples)
    logits = torch.tanh(x @ hidden) @ head + noise * torch.randn(size, classes, generator=samples)
    return x, logits.argmax(dim=1)


def classification(
    features: int = 16,
    classes: int = 8,
    train_size: int = 16384,
    eval_size: int = 512,
    batch_size: int = 64,
    noise: float = 0.1,
    seed: int = 1234,
) -> DataBundle:
    """A DataBundle of generated classification data (the ``data=synthetic`` option).

    Example::

        bundle = classification(batch_size=32)
        loss_name, metric = bundle.loss, bundle.metric   # "cross_entropy", "accuracy"
    """
    train_x, train_y = make_classification(train_size, features, classes, noise, seed)
    eval_x, eval_y = make_classification(eval_size, features, classes, noise, seed, split=1)
    eval_set = sequential_batches(eval_x, eval_y, batch_size)
    return DataBundle(
        fixed_shape=True,
        train_batches=lambda order_seed, position: shuffled_batches(
            train_x, train_y, batch_size, order_seed, position
        ),
        eval_batches=lambda: eval_set,
        batches_per_epoch=train_size // batch_size,
        loss="cross_entropy",
        metric="accuracy",
    )
