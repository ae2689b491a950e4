"""Images through Hugging Face ``datasets``: tables (parquet, arrow) or class folders as train and
val splits, each image decoded by :func:`~giantpipe.data.images.files.read_image` (so an
unreadable one names its file or row), and ``datasets``' progress bars as ``logger.progress``
says.

Example::

    from giantpipe.data.images.hf import HFImageDataset, hf_splits

    hf_train, hf_val = hf_splits(Path("data/imagenet"), cache_dir=None, progress=False)
    data = HFImageDataset(hf_train, transform=train_transforms(224), name="train split")
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from giantpipe.data.images.files import (
    check_class_folders,
    missing_image_data,
    read_image,
    table_files,
)

__all__ = [
    "HFImageDataset",
    "datasets_progress",
    "hf_splits",
    "shows_progress",
]


def shows_progress(style: str) -> bool:
    """``logger.progress`` as data builders read it: ``tqdm`` always, ``none`` never, ``auto``
    when stdout is a terminal (as the training bar)."""
    return style == "tqdm" or (style == "auto" and sys.stdout.isatty())


@contextlib.contextmanager
def datasets_progress(show: bool) -> Iterator[None]:
    """HuggingFace ``datasets``' progress bars on or off for the block, as they were after."""
    import datasets
    import tqdm

    enabled = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if show else datasets.disable_progress_bars)()
    # A disabled tqdm bar still starts tqdm's monitor thread and never stops it; with no
    # monitor the loader leaves no thread behind.
    interval, tqdm.tqdm.monitor_interval = tqdm.tqdm.monitor_interval, 0
    try:
        yield
    finally:
        tqdm.tqdm.monitor_interval = interval
        (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()


class HFImageDataset(Dataset[tuple[Any, int]]):
    """Wraps a HuggingFace ``datasets.Dataset`` with ``image`` and ``label`` columns; images are
    decoded here (:func:`read_image`), so an unreadable one names its file (or its row).

    Example::

        hf = datasets.load_dataset("imagefolder", data_dir="data/imagenet")["train"]
        data = HFImageDataset(hf, transform=train_transforms(224), name="train split")
    """

    def __init__(
        self,
        data: Any,
        transform: Callable[[Any], Any] | None = None,
        image_key: str = "image",
        label_key: str = "label",
        name: str = "the data set",
    ) -> None:
        feature = data.features[image_key]
        if getattr(feature, "decode", False):  # keep the file's bytes and path, decode here
            data = data.cast_column(image_key, type(feature)(decode=False))
        self.data, self.transform, self.name = data, transform, name
        self.image_key, self.label_key = image_key, label_key
        names = getattr(data.features[label_key], "names", None)  # a ClassLabel's
        if names is None:  # plain integer labels: classes 0..max
            names = [str(c) for c in range(max(data[label_key], default=-1) + 1)]
        self.classes: list[str] = list(names)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        row = self.data[index]
        cell = row[self.image_key]
        named = cell.get("path") or f"row {index + 1} of {self.name}"
        image = read_image(cell["bytes"] or cell["path"], named)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(row[self.label_key])


def hf_splits(root: Path, cache_dir: str | None, progress: bool) -> tuple[Any, Any]:
    """The train and validation splits of ``root`` as ``datasets`` reads them: its parquet or
    arrow tables (paths saying train / val), else its class folders."""
    import datasets  # heavy import, only when asked for

    kind, tables = table_files(root)
    with datasets_progress(progress):
        if tables:
            train = [str(p) for p in tables if "train" in p.relative_to(root).as_posix()]
            val = [str(p) for p in tables if "val" in p.relative_to(root).as_posix()]
            if not train or not val:
                raise missing_image_data(root / ("train" if not train else "val"))
            files = {"train": train, "validation": val}
            splits = datasets.load_dataset(kind, data_files=files, cache_dir=cache_dir)
        else:
            check_class_folders(root)
            splits = datasets.load_dataset("imagefolder", data_dir=str(root), cache_dir=cache_dir)
    return splits["train"], splits["validation"]
