"""Image files: reading them (every kind of image as RGB, every unreadable file named) and
checking them (the image root, its class folders, the class count, the unreadable files a run
meets), each problem one line that says what to do.

Example::

    from giantpipe.data.images.files import BadFiles, check_image_root, read_image

    read_image("data/val/cat/17.png").size     # (width, height), mode "RGB"
    check_image_root(Path("data/imagenet"), source="imagefolder")
    # ConfigError: data.root: no image data at /.../data/imagenet: put ImageNet there as ...
    batches = BadFiles(skip=True).batches(loader)   # unreadable images left out and counted
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from giantpipe.config import ConfigError
from giantpipe.data.bundle import Batch

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage


__all__ = [
    "BadFiles",
    "BadImage",
    "CheckedLoader",
    "Readable",
    "UnreadableImage",
    "check_class_folders",
    "check_classes",
    "check_image_root",
    "collate_readable",
    "missing_data",
    "missing_image_data",
    "read_image",
    "table_files",
]


log = logging.getLogger(__name__)


class UnreadableImage(OSError):
    """A file PIL cannot read in full (not an image, truncated, ...); the message names it."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: not a readable image ({reason})")
        self.name, self.reason = name, reason


@dataclass(frozen=True)
class BadImage:
    """Stands in for an unreadable image in a batch: a loader worker returns it instead of
    raising, so the training process learns which file it was (a worker's error reaches it as
    "Caught OSError in DataLoader worker process 0", the file nowhere)."""

    name: str
    reason: str


def _eight_bit(image: PILImage) -> PILImage:
    """16- and 32-bit integer grey images scaled to 8 bits (PIL would clip them at 255)."""
    from PIL import Image

    if image.mode not in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        return image
    pixels = np.asarray(image, dtype=np.float64)
    top = 65535.0 if image.mode.startswith("I;16") else max(float(pixels.max()), 1.0)
    return Image.fromarray(np.clip(pixels * (255.0 / top), 0, 255).astype(np.uint8), "L")


def read_image(source: str | Path | bytes, name: str | None = None) -> PILImage:
    """The image at ``source`` (a path, or encoded bytes called ``name``) decoded in full as RGB:
    grey (8 or 16 bits), palette, alpha and CMYK images are converted, any size is kept. A file
    PIL cannot read is an :class:`UnreadableImage` naming it.

    Example::

        read_image("data/val/cat/17.png").size        # (width, height), mode "RGB"
    """
    from PIL import Image

    label = name or str(source)
    try:
        opened = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        with opened as image:
            return _eight_bit(image).convert("RGB")
    except Image.UnidentifiedImageError as err:  # its message repeats the path
        raise UnreadableImage(label, "not an image format PIL knows") from err
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnreadableImage(label, reason) from err


class Readable(Dataset[Any]):
    """``data[index]``, or a :class:`BadImage` when its file cannot be read (see there why).

    Example::

        loader = DataLoader(Readable(val), batch_size=64, collate_fn=collate_readable)
        batch, bad = next(iter(loader))     # bad: [BadImage("val/cat/3.png", "truncated")]
    """

    def __init__(self, data: Dataset[Any]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.data[index]
        except UnreadableImage as err:
            return BadImage(err.name, err.reason)


def collate_readable(samples: list[Any]) -> tuple[Any, list[BadImage]]:
    """(the default collation of the readable samples or None, the :class:`BadImage` ones)."""
    from torch.utils.data import default_collate

    good = [s for s in samples if not isinstance(s, BadImage)]
    bad = [s for s in samples if isinstance(s, BadImage)]
    return (default_collate(good) if good else None), bad


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


def table_files(root: Path) -> tuple[str, list[Path]]:
    """(``"parquet"`` or ``"arrow"``, the files under ``root``): tables ``datasets`` reads as they
    are; ``("", [])`` when there are none (then ``root`` holds class folders)."""
    for kind in ("parquet", "arrow"):
        files = sorted(root.rglob(f"*.{kind}"))
        if files:
            return kind, files
    return "", []


def check_class_folders(root: Path) -> list[str]:
    """The classes of ``root/train`` and ``root/val``: the same folders in both, each holding an
    image (searched until the first). A FileNotFoundError names the split and the class.

    Example::

        check_class_folders(Path("data/imagenet"))      # ["n01440764", ...]
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS

    splits = ("train", "val")
    found = {s: sorted(e.name for e in os.scandir(root / s) if e.is_dir()) for s in splits}
    if not found["train"]:
        raise FileNotFoundError(f"{root / 'train'} holds no class folders (train/<class>/*.jpg)")
    for split, other in (("val", "train"), ("train", "val")):
        lacking = sorted(set(found[other]) - set(found[split]))
        if lacking:
            raise FileNotFoundError(
                f"{root / split} has no folder for class {lacking[0]!r} ({other}/{lacking[0]} "
                "exists); every class needs a folder in train/ and in val/"
            )
    for split in splits:
        for name in found[split]:
            folder = root / split / name
            files = (f for _, _, names in os.walk(folder) for f in names)
            if not any(f.lower().endswith(IMG_EXTENSIONS) for f in files):
                raise FileNotFoundError(
                    f"{folder} holds no images ({', '.join(IMG_EXTENSIONS)}): class {name!r} "
                    f"of {split}/ is empty; add its images or remove its folders"
                )
    return found["train"]


def missing_image_data(path: Path) -> FileNotFoundError:
    """The error for a missing image directory when the library reads one: where ImageNet
    goes, and the quick start (:func:`missing_data` is the command line's)."""
    return FileNotFoundError(
        f"no image data at {path.resolve()}: put ImageNet there as train/ and val/ class "
        f"folders (train/<class>/*.JPEG, val/<class>/*.JPEG), or run `python train.py` for the "
        f"quick start on generated data"
    )


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


def check_classes(data: Dataset[Any], num_classes: int, root: Path) -> None:
    """A ConfigError naming ``data.num_classes`` unless ``data`` holds that many classes."""
    classes = list(getattr(data, "classes", []))
    if len(classes) != num_classes:
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        raise ConfigError(
            "data.num_classes",
            f"is {num_classes} but {root} holds {len(classes)} classes ({shown}); set "
            f"data.num_classes={len(classes)}",
        )
