"""ImageNet-style train and val data sets from a root directory: class folders read by
torchvision's ImageFolder, or folders and tables read by Hugging Face ``datasets``, with the
paper's transforms.

Example::

    from giantpipe.data.images.folders import build_image_datasets

    # ImageNet laid out as <root>/train/<class>/*.JPEG and <root>/val/<class>/*.JPEG:
    train, val = build_image_datasets("data/imagenet", image_size=224, cutout=0)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from torch.utils.data import Dataset

from giantpipe.data.images.files import check_class_folders, missing_image_data, read_image
from giantpipe.data.images.hf import HFImageDataset, hf_splits
from giantpipe.data.images.transforms import eval_transforms, train_transforms

__all__ = [
    "build_image_datasets",
]


def build_image_datasets(
    root: str | Path,
    image_size: int = 224,
    scale: tuple[float, float] = (0.08, 1.0),
    hflip: bool = True,
    cutout: int = 0,
    source: Literal["imagefolder", "hf"] = "imagefolder",
    cache_dir: str | None = None,
    progress: bool = False,
) -> tuple[Dataset[Any], Dataset[Any]]:
    """Train and validation data sets from ``root``: ``train/`` and ``val/`` class folders read
    by torchvision ``ImageFolder`` (``source="imagefolder"``) or by HuggingFace ``datasets``
    (``source="hf"``: the same folders, or parquet or arrow files whose paths contain "train" /
    "val";
    ``progress``: its progress bars). Training uses :func:`train_transforms`, validation
    :func:`eval_transforms`; images are read by :func:`read_image`. Class folders are checked
    by :func:`check_class_folders`.

    Example::

        train, val = build_image_datasets("data/imagenet", image_size=480, cutout=120)
        image, label = train[0]                  # (3, 480, 480), int
    """
    root = Path(root)
    if not root.is_dir():
        raise missing_image_data(root)
    train_tf = train_transforms(image_size, scale, hflip, cutout)
    eval_tf = eval_transforms(image_size)
    if source == "hf":
        hf_train, hf_val = hf_splits(root, cache_dir, progress)
        return (
            HFImageDataset(hf_train, train_tf, name=f"the train split of {root}"),
            HFImageDataset(hf_val, eval_tf, name=f"the val split of {root}"),
        )
    if source != "imagefolder":
        raise ValueError(f"source must be 'imagefolder' or 'hf', got {source!r}")
    from torchvision.datasets import ImageFolder

    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise missing_image_data(root / split)
    check_class_folders(root)
    train = ImageFolder(root / "train", train_tf, loader=read_image)
    return train, ImageFolder(root / "val", eval_tf, loader=read_image)
