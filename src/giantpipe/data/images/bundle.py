"""Image classification DataBundles for the runner: generated, random, and ImageNet-style folders.

One builder per option: :func:`generated_images` (``data=images_generated``),
:func:`random_images` (``data=images_random``) and :func:`image_folder`
(``data=images_folder``), every training stream a pure function of ``(seed, position)``,
augmentations included (docs/your-data.md#image-streams).

Example::

    bundle = generated_images(image_size=32, num_classes=10, batch_size=64)
    images, labels = next(bundle.train_batches(seed=0, position=0))   # (64, 3, 32, 32), (64,)

    bundle = image_folder("data/imagenet", num_classes=1000, image_size=224, batch_size=256)
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from giantpipe.config import ConfigError
from giantpipe.data.batch_order import sequential_batches, shuffled_batches
from giantpipe.data.bundle import Batch, DataBundle
from giantpipe.data.images.files import (
    BadFiles,
    CheckedLoader,
    Readable,
    check_classes,
    check_image_root,
)
from giantpipe.data.images.folders import build_image_datasets
from giantpipe.data.images.generated import GeneratedImages
from giantpipe.data.images.hf import shows_progress
from giantpipe.data.images.loaders import loader_options, train_stream

__all__ = [
    "generated_images",
    "image_folder",
    "random_images",
]


METRIC = "top5"
"""Image bundles report top-1 (``accuracy``) and top-5 (``top5``) accuracy, as the paper does."""


def render_all(data: GeneratedImages) -> tuple[Tensor, Tensor]:
    """Every (normalized image, label) of ``data`` stacked into two tensors.

    Example::

        images, labels = render_all(GeneratedImages(size=100, image_size=32))   # (100, 3, 32, 32)
    """
    images = torch.empty(len(data), 3, data.image_size, data.image_size)
    labels = torch.empty(len(data), dtype=torch.int64)
    for index in range(len(data)):
        images[index], labels[index] = data[index]
    return images, labels


def generated_images(
    image_size: int = 32,
    num_classes: int = 10,
    train_size: int = 4096,
    eval_size: int = 512,
    batch_size: int = 64,
    noise: float = 0.08,
    seed: int = 0,
) -> DataBundle:
    """Generated textured images (:class:`~giantpipe.data.images.generated.GeneratedImages`),
    rendered once into memory; held-out images come from ``seed + 1``. Batches are shuffled per
    epoch by the training seed, the last partial batch of an epoch dropped.

    Example::

        bundle = generated_images(image_size=32, train_size=1024, batch_size=32)
        bundle.batches_per_epoch       # 32
    """
    train_x, train_y = render_all(GeneratedImages(train_size, image_size, num_classes, seed, noise))
    held_out = GeneratedImages(eval_size, image_size, num_classes, seed + 1, noise)
    eval_x, eval_y = render_all(held_out)
    eval_set = sequential_batches(eval_x, eval_y, batch_size)
    return DataBundle(
        fixed_shape=True,
        train_batches=lambda order_seed, position: shuffled_batches(
            train_x, train_y, batch_size, order_seed, position
        ),
        eval_batches=lambda: eval_set,
        batches_per_epoch=train_size // batch_size,
        loss="cross_entropy",
        metric=METRIC,
        eval_set=f"{eval_size} generated held-out images (seed {seed + 1})",
    )


def random_images(
    image_size: int = 224,
    num_classes: int = 1000,
    batch_size: int = 128,
    epoch_size: int = 1281167,
    seed: int = 0,
) -> DataBundle:
    """One batch of standard-normal pixels and uniform labels, repeated: nothing to load or
    learn, so a run measures the model and the pipeline alone; the evaluation runs on the next
    batch drawn. ``epoch_size`` (ImageNet's by default) only sets how many steps an "epoch" is.

    Example::

        bundle = random_images(image_size=224, batch_size=16)
        images, labels = next(bundle.train_batches(0, 0))       # (16, 3, 224, 224), (16,)
    """
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    labels = torch.randint(num_classes, (batch_size,), generator=generator)
    batch: Batch = (images, labels)
    # evaluation on the next batch of the stream, not the one trained on (it would be memorised)
    held_out: Batch = (
        torch.randn(batch_size, 3, image_size, image_size, generator=generator),
        torch.randint(num_classes, (batch_size,), generator=generator),
    )
    return DataBundle(
        fixed_shape=True,
        train_batches=lambda _seed, _position: itertools.repeat(batch),
        eval_batches=lambda: [held_out],
        batches_per_epoch=max(1, epoch_size // batch_size),
        loss="cross_entropy",
        metric=METRIC,
    )


def image_folder(
    root: str,
    num_classes: int = 1000,
    image_size: int = 224,
    batch_size: int = 256,
    eval_batch_size: int | None = None,
    source: str = "imagefolder",
    min_scale: float = 0.08,
    hflip: bool = True,
    cutout: int = 0,
    num_workers: int = 8,
    cache_dir: str | None = None,
    skip_bad_files: bool = False,
    progress: str = "auto",
) -> DataBundle:
    """ImageNet-style data from ``root``: ``train/`` and ``val/`` class folders read by
    torchvision's ImageFolder (``source="imagefolder"``) or by HuggingFace ``datasets``
    (``source="hf"``: the same folders, or parquet / arrow files). Training batches are augmented
    (random-resized crop to ``image_size`` with area fraction >= ``min_scale``, flip, cutout),
    evaluation batches resized by 256/224 and center-cropped. Grey or colour images of any size
    become RGB at ``image_size``. ``num_classes`` and the class folders are checked; an
    unreadable image stops the run naming it, or is skipped and counted (``skip_bad_files``).
    ``progress`` (the runner's ``logger.progress``) shows or hides ``datasets``' bars.

    Example::

        bundle = image_folder("data/imagenet", num_classes=1000, image_size=480,
                              batch_size=256, num_workers=16)
    """
    if source not in ("imagefolder", "hf"):
        raise ConfigError("data.source", f"must be imagefolder or hf, got {source!r}")
    directory = Path(root).expanduser()
    check_image_root(directory, source)
    try:
        train, val = build_image_datasets(
            directory,
            image_size,
            (min_scale, 1.0),
            hflip,
            cutout,
            source,  # type: ignore[arg-type]
            cache_dir,
            shows_progress(progress),
        )
    except FileNotFoundError as err:  # e.g. a class folder missing from val/, or empty
        raise ConfigError("data.root", str(err)) from err
    check_classes(train, num_classes, directory)
    size: int = len(train)  # type: ignore[arg-type]
    if size < batch_size:
        raise ConfigError(
            "data.batch_size", f"{batch_size} exceeds the {size} training images in {directory}"
        )
    files = BadFiles(skip_bad_files)
    eval_loader = DataLoader(
        Readable(val),
        batch_size=eval_batch_size or batch_size,
        shuffle=False,
        persistent_workers=num_workers > 0,
        **loader_options(num_workers, 0),
    )
    return DataBundle(
        fixed_shape=True,
        train_batches=lambda seed, position: train_stream(
            train, batch_size, seed, position, num_workers, files
        ),
        eval_batches=lambda: CheckedLoader(eval_loader, files),
        batches_per_epoch=size // batch_size,
        loss="cross_entropy",
        metric=METRIC,
        eval_set=f"{directory / 'val'}" if source == "imagefolder" else f"the val split of {root}",
    )
