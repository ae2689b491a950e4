"""Data you already have as tensors: ``ROOT/train.pt`` and ``ROOT/eval.pt``.

Each file holds a tuple ``(inputs, targets)`` of tensors saved with ``torch.save``; inputs are
``(N, ..., features)``. Training batches are shuffled by (seed, epoch) like the generated data.

Example::

    torch.save((x_train, y_train), "mydata/train.pt")
    torch.save((x_eval, y_eval), "mydata/eval.pt")
    # python train.py data=tensors data.root=mydata data.features=784 data.classes=10
"""

from __future__ import annotations

from pathlib import Path

import torch

from giantpipe.config import ConfigError
from giantpipe.data.bundle import DataBundle
from giantpipe.data.synthetic import sequential_batches, shuffled_batches


def load_split(root: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Load ``root/split.pt``; a missing file is a ConfigError naming ``data.root``."""
    path = root / f"{split}.pt"
    if not path.is_file():
        raise ConfigError("data.root", f"{path} not found (expected {split}.pt in {root})")
    inputs, targets = torch.load(path, weights_only=True)
    return inputs, targets


def tensor_files(
    root: str, features: int, classes: int, batch_size: int = 64, loss: str = "cross_entropy"
) -> DataBundle:
    """A DataBundle over ``root/train.pt`` and ``root/eval.pt`` (the ``data=tensors`` option).

    ``features`` (input width) is checked against the files; ``classes`` is the model's output
    width, which the model config reads from here.

    Example::

        bundle = tensor_files("mydata", features=784, classes=10, batch_size=32)
    """
    directory = Path(root).expanduser()
    if not directory.is_dir():
        raise ConfigError("data.root", f"directory not found: {directory}")
    train_x, train_y = load_split(directory, "train")
    eval_x, eval_y = load_split(directory, "eval")
    if train_x.shape[-1] != features:
        raise ConfigError("data.features", f"is {features}; the inputs have {train_x.shape[-1]}")
    if len(train_x) < batch_size:
        raise ConfigError("data.batch_size", f"{batch_size} exceeds the {len(train_x)} samples")
    eval_set = sequential_batches(eval_x, eval_y, batch_size)
    return DataBundle(
        train_batches=lambda seed, position: shuffled_batches(
            train_x, train_y, batch_size, seed, position
        ),
        eval_batches=lambda: eval_set,
        batches_per_epoch=len(train_x) // batch_size,
        loss=loss,
        metric="accuracy" if loss == "cross_entropy" else None,
    )
