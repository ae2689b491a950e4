"""The ``data=tensors`` option: your own ``train.pt`` / ``eval.pt``, loaded as data only.

``ROOT/train.pt`` and ``ROOT/eval.pt``, each a tuple ``(inputs, targets)`` saved with
``torch.save``, inputs ``(N, ..., features)``. Fields: ``TensorDataConfig``
(:mod:`giantpipe.data.options`).

Example::

    torch.save((x_train, y_train), "mydata/train.pt")
    torch.save((x_eval, y_eval), "mydata/eval.pt")
    # python train.py recipe=mlp_quickstart data=tensors data.root=mydata data.features=784 \
    #     data.classes=10
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from torch import Tensor

from giantpipe.config import ConfigError
from giantpipe.data.batch_order import sequential_batches, shuffled_batches
from giantpipe.data.bundle import DataBundle


def load_split(root: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Load ``root/split.pt`` as data only (``weights_only``: tensors and plain values, nothing
    that runs code); a missing, unreadable or unsafe file is a ConfigError naming ``data.root``
    and the file.

    Example::

        load_split(Path("mydata"), "train")
        # ConfigError: data.root: mydata/train.pt holds posix.system, which a data file of
        # tensors never needs; refused without running it (...)
    """
    path = root / f"{split}.pt"
    if not path.is_file():
        raise ConfigError("data.root", f"{path} not found (expected {split}.pt in {root})")
    try:
        loaded = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(err))
        if unsafe is None:
            raise ConfigError("data.root", f"{path} is not a readable torch file") from err
        raise ConfigError(
            "data.root",
            f"{path} holds {unsafe.group(1)}, which a data file of tensors never needs; refused "
            "without running it (load it yourself only if you trust where it came from, and "
            "save its tensors again: torch.save((inputs, targets), PATH))",
        ) from err
    except Exception as err:  # a truncated or foreign file: say which one, on one line
        reason = " ".join(str(err).split())[:200]
        raise ConfigError("data.root", f"{path} is not a readable torch file ({reason})") from err
    pair = isinstance(loaded, tuple | list) and len(loaded) == 2
    if not (pair and all(isinstance(t, Tensor) for t in loaded)):
        raise ConfigError("data.root", f"{path} must hold a tuple (inputs, targets) of two tensors")
    inputs, targets = loaded
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
        fixed_shape=True,
        train_batches=lambda seed, position: shuffled_batches(
            train_x, train_y, batch_size, seed, position
        ),
        eval_batches=lambda: eval_set,
        batches_per_epoch=len(train_x) // batch_size,
        loss=loss,
        metric="accuracy" if loss == "cross_entropy" else None,
        eval_set=str(directory / "eval.pt"),
    )
