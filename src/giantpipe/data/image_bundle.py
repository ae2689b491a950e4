"""Image classification DataBundles for the runner: generated, random, and ImageNet-style folders.

Three builders, one per ``data=`` option:

- :func:`generated_images` (``data=images_generated``): learnable textured images rendered from a
  seed, no files (the quick start);
- :func:`random_images` (``data=images_random``): random pixels and labels, one fixed batch, for
  throughput measurements (what torchgpipe's benchmarks call fake data);
- :func:`image_folder` (``data=images_folder``): ImageNet laid out as ``train/<class>/*`` and
  ``val/<class>/*`` (or parquet / arrow files through HuggingFace ``datasets``), with the paper's
  training transforms (random-resized crop, flip, optional cutout) and evaluation transforms
  (resize + center crop), loaded by worker processes into pinned memory when a GPU is present.

Every training stream is a pure function of ``(seed, position)``, random augmentations
included: batch ``p`` is batch ``p % per_epoch`` of epoch ``p // per_epoch``'s permutation, and
each image's crop, flip and cutout are drawn from an RNG seeded by (seed, epoch, image index).
So a resumed run sees exactly the batches an uninterrupted run would have seen.

Example::

    bundle = generated_images(image_size=32, num_classes=10, batch_size=64)
    images, labels = next(bundle.train_batches(seed=0, position=0))   # (64, 3, 32, 32), (64,)

    bundle = image_folder("data/imagenet", num_classes=1000, image_size=224, batch_size=256)
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from giantpipe.config import (
    ConfigError,
    check,
    check_choice,
    check_fits_memory,
    check_min,
    check_optional_path,
)
from giantpipe.data.bundle import Batch, DataBundle
from giantpipe.data.images import (
    BadImage,
    GeneratedImages,
    Readable,
    build_image_datasets,
    collate_readable,
    shows_progress,
    table_files,
)
from giantpipe.data.tensors import epoch_order, sequential_batches, shuffled_batches

__all__ = [
    "BadFiles",
    "EpochBatches",
    "SeededTransforms",
    "generated_images",
    "image_folder",
    "random_images",
    "sample_seed",
]

log = logging.getLogger(__name__)

METRIC = "top5"
"""Image bundles report top-1 (``accuracy``) and top-5 (``top5``) accuracy, as the paper does."""


# --------------------------------------------------------------------------------------------
# Generated and random images: tensors in memory.
# --------------------------------------------------------------------------------------------


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


def _check_image_batches(image_size: int, batch_size: int, num_classes: int) -> None:
    check_min(image_size, 8, "data.image_size")
    check_min(batch_size, 1, "data.batch_size")
    check_min(num_classes, 2, "data.num_classes")


def generated_images(
    image_size: int = 32,
    num_classes: int = 10,
    train_size: int = 4096,
    eval_size: int = 512,
    batch_size: int = 64,
    noise: float = 0.08,
    seed: int = 0,
) -> DataBundle:
    """Generated textured images (:class:`~giantpipe.data.images.GeneratedImages`), rendered
    once into memory; held-out images come from ``seed + 1``. Batches are shuffled per epoch by
    the training seed, the last partial batch of an epoch dropped.

    Example::

        bundle = generated_images(image_size=32, train_size=1024, batch_size=32)
        bundle.batches_per_epoch       # 32
    """
    train_x, train_y = render_all(GeneratedImages(train_size, image_size, num_classes, seed, noise))
    held_out = GeneratedImages(eval_size, image_size, num_classes, seed + 1, noise)
    eval_x, eval_y = render_all(held_out)
    eval_set = sequential_batches(eval_x, eval_y, batch_size)
    return DataBundle(
        train_batches=lambda order_seed, position: shuffled_batches(
            train_x, train_y, batch_size, order_seed, position
        ),
        eval_batches=lambda: eval_set,
        batches_per_epoch=train_size // batch_size,
        loss="cross_entropy",
        metric=METRIC,
        eval_set=f"{eval_size} generated held-out images (seed {seed + 1})",
    )


@dataclass
class GeneratedImagesDataConfig:
    """``data=images_generated``: the arguments of :func:`generated_images`, checked up front."""

    _target_: str = "giantpipe.data.image_bundle.generated_images"
    """Builder called with the other fields."""
    image_size: int = 32
    """Height and width in pixels."""
    num_classes: int = 10
    """Classes (each a pattern family, orientation and colour pair)."""
    train_size: int = 4096
    """Training images (rendered once at start-up, about 1 ms each at 32 px)."""
    eval_size: int = 512
    """Held-out images (rendered from seed + 1, so never training images)."""
    batch_size: int = 64
    """Mini-batch size N."""
    noise: float = 0.08
    """Pixel noise (higher: harder)."""
    seed: int = 0
    """Seed of the images (the batch order follows trainer.seed)."""

    def __post_init__(self) -> None:
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        check(
            self.batch_size <= self.train_size,
            "data.batch_size",
            f"must be <= data.train_size ({self.train_size}), got {self.batch_size}",
        )
        check_min(self.eval_size, 1, "data.eval_size")
        check_min(self.noise, 0.0, "data.noise")
        # Every image is rendered once into memory at start-up (float32, 3 channels).
        check_fits_memory(
            (self.train_size + self.eval_size) * (12 * self.image_size**2 + 8),
            "data.train_size, data.eval_size, data.image_size",
            "the rendered images",
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
        train_batches=lambda _seed, _position: itertools.repeat(batch),
        eval_batches=lambda: [held_out],
        batches_per_epoch=max(1, epoch_size // batch_size),
        loss="cross_entropy",
        metric=METRIC,
    )


@dataclass
class RandomImagesDataConfig:
    """``data=images_random``: the arguments of :func:`random_images`, checked up front."""

    _target_: str = "giantpipe.data.image_bundle.random_images"
    """Builder called with the other fields."""
    image_size: int = 224
    """Height and width in pixels."""
    num_classes: int = 1000
    """Label range."""
    batch_size: int = 128
    """Mini-batch size N."""
    epoch_size: int = 1281167
    """Images per "epoch" (ImageNet's), so epoch-valued schedules mean what they would there."""
    seed: int = 0
    """Seed of the pixels and labels."""

    def __post_init__(self) -> None:
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        check_fits_memory(
            12 * self.batch_size * self.image_size**2,
            "data.batch_size, data.image_size",
            "the one batch of random images",
        )
        check(
            self.epoch_size >= self.batch_size,
            "data.epoch_size",
            f"must be >= data.batch_size ({self.batch_size}), got {self.epoch_size}",
        )


# --------------------------------------------------------------------------------------------
# ImageNet-style folders: resumable, seeded augmentation through worker processes.
# --------------------------------------------------------------------------------------------


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one image's random transforms in one epoch: a hash, so no two collide.

    Example::

        sample_seed(0, epoch=3, index=17)     # the same number on every machine and worker
    """
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class EpochBatches(Sampler[list[tuple[int, int]]]):
    """Endless batches of ``(sample seed, image index)`` from batch ``position`` on.

    Batch ``p`` holds images ``p % per_epoch`` of epoch ``p // per_epoch``'s permutation (the
    one :func:`giantpipe.data.tensors.epoch_order` gives), the last partial batch dropped.

    Example::

        batches = iter(EpochBatches(size=1000, batch_size=64, seed=0, position=20))
        first = next(batches)           # 64 pairs (seed, index) of batch 20 = epoch 1, batch 5
    """

    def __init__(self, size: int, batch_size: int, seed: int, position: int) -> None:
        if size < batch_size:
            raise ValueError(f"{size} images cannot fill one batch of {batch_size}")
        self.size, self.batch_size, self.seed, self.position = size, batch_size, seed, position

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        per_epoch = self.size // self.batch_size
        epoch, index = divmod(self.position, per_epoch)
        while True:
            order = epoch_order(self.size, self.seed, epoch).tolist()
            for batch in range(index, per_epoch):
                take = order[batch * self.batch_size : (batch + 1) * self.batch_size]
                yield [(sample_seed(self.seed, epoch, i), i) for i in take]
            epoch, index = epoch + 1, 0


class SeededTransforms(Dataset[Any]):
    """Reads ``(sample seed, index)``: the wrapped data set's random transforms draw from the
    torch RNG seeded with the sample seed, so an image's augmentation does not depend on which
    worker loads it or on what ran before. The caller's RNG state is left untouched. An
    unreadable image comes back as a :class:`~giantpipe.data.images.BadImage`.

    Example::

        data = SeededTransforms(ImageFolder("data/imagenet/train", train_transforms(224)))
        image, label = data[(1234, 0)]      # the same crop every time
    """

    def __init__(self, data: Dataset[Any]) -> None:
        self.data = Readable(data)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        seed, index = item
        # fork_rng restores the CPU RNG afterwards: loading in the training process
        # (num_workers=0) must not shift the RNG that dropout and drop-path draw from.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.data[index]


def _loader_options(num_workers: int, seed: int) -> dict[str, Any]:
    # A generator of our own: without one, every new iterator draws its workers' base seed from
    # the global RNG, and a resumed run would draw at another point than an uninterrupted one.
    return {
        "num_workers": num_workers,
        "pin_memory": torch.cuda.is_available(),
        "generator": torch.Generator().manual_seed(seed),
        "collate_fn": collate_readable,
    }


class BadFiles:
    """What the training process does with the unreadable images its loaders report: stop with
    one line naming the file (the default), or (``data.skip_bad_files``) leave the image out of
    its batch, logging each file once with the count so far.

    Example::

        files = BadFiles(skip=True)
        batches = files.batches(loader)       # loader yields (batch or None, [BadImage, ...])
        len(files.skipped)                    # files skipped so far
    """

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.skipped: dict[str, str] = {}

    def report(self, bad: BadImage) -> None:
        if not self.skip:
            raise ConfigError(
                "data.root",
                f"{bad.name}: not a readable image ({bad.reason}); remove it, or set "
                "data.skip_bad_files=true to skip and count such files",
            )
        if bad.name not in self.skipped:
            self.skipped[bad.name] = bad.reason
            count = len(self.skipped)
            log.warning(
                "skipped unreadable image %s (%s): %d skipped so far", bad.name, bad.reason, count
            )

    def batches(self, loader: Iterable[tuple[Batch | None, list[BadImage]]]) -> Iterator[Batch]:
        """The loader's batches with their unreadable images reported (a batch of nothing but
        unreadable images is left out)."""
        for batch, bad in loader:
            for item in bad:
                self.report(item)
            if batch is not None:
                yield batch


class CheckedLoader:
    """An evaluation loader's batches through :meth:`BadFiles.batches`; its length is the
    loader's (the runner sizes an evaluation by it)."""

    def __init__(self, loader: DataLoader[Any], files: BadFiles) -> None:
        self.loader, self.files = loader, files

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        return self.files.batches(self.loader)


def train_stream(
    data: Dataset[Any],
    batch_size: int,
    seed: int,
    position: int,
    num_workers: int,
    files: BadFiles | None = None,
) -> Iterator[Batch]:
    """Endless augmented training batches from batch ``position`` (see :class:`EpochBatches`);
    unreadable images go to ``files`` (default: stop at the first, naming it).

    Example::

        stream = train_stream(train_set, batch_size=256, seed=0, position=0, num_workers=8)
        images, labels = next(stream)
    """
    sampler = EpochBatches(len(data), batch_size, seed, position)  # type: ignore[arg-type]
    loader = DataLoader(
        SeededTransforms(data), batch_sampler=sampler, **_loader_options(num_workers, seed)
    )
    return (files or BadFiles(skip=False)).batches(loader)


def missing_data(path: Path) -> ConfigError:
    """The one-line error for a missing data directory: where ImageNet goes, and the way out."""
    return ConfigError(
        "data.root",
        f"no image data at {path.resolve()}: put ImageNet there as train/ and val/ class folders "
        "(train/<class>/*.JPEG, val/<class>/*.JPEG) or point data.root=DIR at them; to try "
        "giantpipe without ImageNet, run the quick start on generated images: python train.py",
    )


def check_image_root(root: Path, source: str) -> None:
    """Raise :func:`missing_data` unless ``root`` has train/ and val/ (or, for ``hf``, parquet or
    arrow files, whose paths say train / val)."""
    if not root.is_dir():
        raise missing_data(root)
    if source == "hf" and table_files(root)[1]:
        return
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise missing_data(root / split)


def _check_classes(data: Dataset[Any], num_classes: int, root: Path) -> None:
    classes = list(getattr(data, "classes", []))
    if len(classes) != num_classes:
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        raise ConfigError(
            "data.num_classes",
            f"is {num_classes} but {root} holds {len(classes)} classes ({shown}); set "
            f"data.num_classes={len(classes)}",
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
    _check_classes(train, num_classes, directory)
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
        **_loader_options(num_workers, 0),
    )
    return DataBundle(
        train_batches=lambda seed, position: train_stream(
            train, batch_size, seed, position, num_workers, files
        ),
        eval_batches=lambda: CheckedLoader(eval_loader, files),
        batches_per_epoch=size // batch_size,
        loss="cross_entropy",
        metric=METRIC,
        eval_set=f"{directory / 'val'}" if source == "imagefolder" else f"the val split of {root}",
    )


@dataclass
class ImageFolderDataConfig:
    """``data=images_folder``: the arguments of :func:`image_folder`, checked up front."""

    _target_: str = "giantpipe.data.image_bundle.image_folder"
    """Builder called with the other fields."""
    root: str = "data/imagenet"
    """Directory with train/<class>/* and val/<class>/* (or parquet / arrow files whose paths say
    train and val, with source=hf)."""
    num_classes: int = 1000
    """Class folders expected (checked against the data; the model reads it)."""
    image_size: int = 224
    """Training crop and evaluation crop size in pixels."""
    batch_size: int = 256
    """Mini-batch size N."""
    eval_batch_size: int | None = None
    """Evaluation batch size (null: data.batch_size)."""
    source: str = "imagefolder"
    """``imagefolder`` (torchvision) or ``hf`` (HuggingFace datasets: folders, parquet, arrow)."""
    min_scale: float = 0.08
    """Smallest area fraction of a random-resized training crop."""
    hflip: bool = True
    """Random horizontal flips in training."""
    cutout: int = 0
    """Side of the Cutout square in pixels (0: none)."""
    num_workers: int = 8
    """Loader worker processes (0: load in the training process)."""
    cache_dir: str | None = None
    """HuggingFace datasets cache (source=hf)."""
    skip_bad_files: bool = False
    """Skip unreadable images (not an image, truncated), listing each in the log with the count;
    false: the first one stops the run, naming the file."""

    def __post_init__(self) -> None:
        check(bool(self.root), "data.root", "must name a directory")
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        if self.eval_batch_size is not None:
            check_min(self.eval_batch_size, 1, "data.eval_batch_size")
        check_choice(self.source, ("imagefolder", "hf"), "data.source")
        check(
            0.0 < self.min_scale <= 1.0,
            "data.min_scale",
            f"must be in (0, 1], got {self.min_scale}",
        )
        check_min(self.cutout, 0, "data.cutout")
        check_min(self.num_workers, 0, "data.num_workers")
        check_optional_path(self.cache_dir, "data.cache_dir")
