"""Image classification data: a generated data set for quick starts and tests, and ImageNet-style
loading (class folders or HuggingFace files) with the GPipe paper's transforms.

Example::

    from giantpipe.data.images import GeneratedImages, build_image_loader

    train = GeneratedImages(size=2048, image_size=32, num_classes=10, seed=0)
    loader = build_image_loader(train, batch_size=64, shuffle=True, num_workers=2, seed=0)
    images, labels = next(iter(loader))          # (64, 3, 32, 32) float, (64,) int64

    # ImageNet laid out as <root>/train/<class>/*.JPEG and <root>/val/<class>/*.JPEG:
    train, val = build_image_datasets("data/imagenet", image_size=224, cutout=0)
"""

from __future__ import annotations

import colorsys
import contextlib
import hashlib
import io
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage
    from torchvision.transforms import v2

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BadImage",
    "Cutout",
    "GeneratedImages",
    "HFImageDataset",
    "Readable",
    "UnreadableImage",
    "build_image_datasets",
    "check_class_folders",
    "build_image_loader",
    "eval_transforms",
    "generated_datasets",
    "read_image",
    "shows_progress",
    "table_files",
    "train_transforms",
    "write_image_folder",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_GOLDEN = 0.6180339887498949
_FAMILIES = ("stripes", "checkerboard", "rings", "dots", "waves")


# --------------------------------------------------------------------------------------------
# Generated images.
# --------------------------------------------------------------------------------------------


def _mix(seed: int, index: int) -> int:
    """A 63-bit seed for one example: a hash of (seed, index), so no two pairs collide."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _class_style(label: int) -> dict[str, Any]:
    """Fixed look of a class (independent of the data set seed, so splits agree): a pattern
    family, an orientation, a frequency and foreground / background colours."""
    family = _FAMILIES[label % len(_FAMILIES)]
    variant = label // len(_FAMILIES)
    hue = (0.13 + label * _GOLDEN) % 1.0
    return {
        "family": family,
        "angle": ((variant * _GOLDEN) % 1.0) * math.pi,
        "freq": 7.0 * (1.0 + 0.45 * (variant % 3)),
        "fg": torch.tensor(colorsys.hsv_to_rgb(hue, 0.8, 0.95)),
        "bg": torch.tensor(colorsys.hsv_to_rgb((hue + 0.5) % 1.0, 0.5, 0.3)),
    }


def _pattern(family: str, u: Tensor, v: Tensor, freq: float) -> Tensor:
    """A texture in [0, 1] over rotated, scaled coordinates (u, v)."""
    if family == "stripes":
        p = torch.sin(freq * u)
    elif family == "checkerboard":
        p = torch.tanh(4.0 * torch.sin(freq * u) * torch.sin(freq * v))
    elif family == "rings":
        p = torch.sin(freq * torch.sqrt(u * u + v * v))
    elif family == "dots":
        p = torch.tanh(3.0 * (torch.cos(freq * u) + torch.cos(freq * v) - 1.0))
    else:  # waves
        p = torch.sin(freq * u + 2.0 * torch.sin(0.5 * freq * v))
    return 0.5 * (p + 1.0)


class GeneratedImages(Dataset[tuple[Tensor, Tensor]]):
    """A learnable synthetic classification data set, generated lazily from (seed, index).

    Class ``c`` (``index % num_classes``) draws a textured patch (stripes, checkerboard, rings,
    dots or waves, with a class-specific orientation, frequency and colour pair) inside a soft
    disc of random position and size, with per-image jitter of angle, frequency and colour plus
    pixel noise. Classes look the same for every seed; examples differ. Costs no memory.

    Example::

        data = GeneratedImages(size=1000, image_size=32, num_classes=10, seed=0)
        image, label = data[3]       # (3, 32, 32) float32 normalized, tensor(3) int64
    """

    def __init__(
        self,
        size: int = 10_000,
        image_size: int = 32,
        num_classes: int = 10,
        seed: int = 0,
        noise: float = 0.08,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        if size < 0 or image_size < 4 or num_classes < 2:
            raise ValueError(
                f"GeneratedImages needs size >= 0, image_size >= 4, num_classes >= 2; got "
                f"size={size}, image_size={image_size}, num_classes={num_classes}"
            )
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.seed, self.noise = seed, noise
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)
        self.classes = [f"class_{c:0{len(str(num_classes - 1))}d}" for c in range(num_classes)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image, label = self.render(index)
        return (image - self.mean) / self.std, torch.tensor(label, dtype=torch.int64)

    def render(self, index: int) -> tuple[Tensor, int]:
        """The un-normalized image (3 x H x W, values in [0, 1]) and label of ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} generated images")
        label = index % self.num_classes
        style = _class_style(label)
        g = torch.Generator().manual_seed(_mix(self.seed, index))
        r = torch.rand(6, generator=g)
        angle = style["angle"] + (r[0].item() - 0.5) * 0.4
        freq = style["freq"] * (0.85 + 0.3 * r[1].item())
        center = (r[2:4] - 0.5) * 0.7
        radius = 0.45 + 0.45 * r[4].item()
        axis = torch.linspace(-1.0, 1.0, self.image_size)
        y, x = torch.meshgrid(axis - center[1], axis - center[0], indexing="ij")
        u = x * math.cos(angle) + y * math.sin(angle)
        v = -x * math.sin(angle) + y * math.cos(angle)
        texture = _pattern(style["family"], u, v, freq)
        inside = torch.sigmoid((radius - torch.sqrt(x * x + y * y)) * 12.0)
        jitter = (torch.rand(2, 3, 1, 1, generator=g) - 0.5) * 0.16
        fg = style["fg"].view(3, 1, 1) + jitter[0]
        bg = style["bg"].view(3, 1, 1) + jitter[1]
        mask = (inside * texture).unsqueeze(0)
        image = bg + (fg - bg) * mask
        image = image + self.noise * torch.randn(3, self.image_size, self.image_size, generator=g)
        return image.clamp_(0.0, 1.0), label


def generated_datasets(
    num_train: int = 10_000,
    num_val: int = 1_000,
    image_size: int = 32,
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[GeneratedImages, GeneratedImages]:
    """Train and held-out generated splits (the held-out split uses seed + 1).

    Example::

        train, val = generated_datasets(num_train=512, num_val=128, image_size=32)
    """
    return (
        GeneratedImages(num_train, image_size, num_classes, seed),
        GeneratedImages(num_val, image_size, num_classes, seed + 1),
    )


def write_image_folder(
    root: str | Path,
    num_train: int = 200,
    num_val: int = 50,
    image_size: int = 32,
    num_classes: int = 10,
    seed: int = 0,
) -> Path:
    """Writes generated images as PNG files in the ImageNet layout
    ``root/{train,val}/<class>/<index>.png`` and returns ``root``. Validation images are the
    indices after the training ones in the same seeded stream, so the splits never overlap.

    Example::

        root = write_image_folder("data/generated", num_train=200, num_val=50)
        train, val = build_image_datasets(root, image_size=32)
    """
    from PIL import Image

    root = Path(root)
    data = GeneratedImages(num_train + num_val, image_size, num_classes, seed)
    for index in range(num_train + num_val):
        image, label = data.render(index)
        split = "train" if index < num_train else "val"
        folder = root / split / data.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image * 255.0).round().to(torch.uint8).permute(1, 2, 0).contiguous()
        png = Image.frombytes("RGB", (image_size, image_size), bytes(pixels.flatten().tolist()))
        png.save(folder / f"{index:07d}.png")
    return root


# --------------------------------------------------------------------------------------------
# Transforms (GPipe paper: random-resized crop, flip, cutout; eval: resize 256/224 + crop).
# --------------------------------------------------------------------------------------------


class Cutout:
    """Zeroes one random ``size`` x ``size`` square (clipped at the borders) of a C x H x W
    tensor, after normalization (DeVries & Taylor 2017). Uses the torch RNG.

    Example::

        image = Cutout(16)(torch.randn(3, 224, 224))
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"Cutout size must be >= 0, got {size}")
        self.size = size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size})"

    def __call__(self, image: Tensor) -> Tensor:
        if self.size == 0:
            return image
        height, width = image.shape[-2:]
        cy = int(torch.randint(height, ()).item())
        cx = int(torch.randint(width, ()).item())
        top, left = max(cy - self.size // 2, 0), max(cx - self.size // 2, 0)
        image = image.clone()
        image[..., top : cy + (self.size + 1) // 2, left : cx + (self.size + 1) // 2] = 0.0
        return image


def _to_normalized_tensor(mean: Sequence[float], std: Sequence[float]) -> list[Any]:
    from torchvision.transforms import v2  # heavy (about as long as torch): only when used

    return [
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(list(mean), list(std)),
    ]


def train_transforms(
    image_size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    hflip: bool = True,
    cutout: int = 0,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> v2.Compose:
    """RandomResizedCrop + horizontal flip + normalize (+ Cutout when ``cutout`` > 0).

    Example::

        tf = train_transforms(224, cutout=56)
        tensor = tf(pil_image)                   # (3, 224, 224)
    """
    from torchvision.transforms import v2

    steps: list[Any] = [v2.RandomResizedCrop(image_size, scale=scale, antialias=True)]
    if hflip:
        steps.append(v2.RandomHorizontalFlip())
    steps += _to_normalized_tensor(mean, std)
    if cutout > 0:
        steps.append(Cutout(cutout))
    return v2.Compose(steps)


def eval_transforms(
    image_size: int,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> v2.Compose:
    """Resize the short side to image_size * 256 / 224, center crop, normalize.

    Example::

        tensor = eval_transforms(224)(pil_image)  # (3, 224, 224)
    """
    from torchvision.transforms import v2

    resize = int(round(image_size * 256 / 224))
    return v2.Compose(
        [v2.Resize(resize, antialias=True), v2.CenterCrop(image_size)]
        + _to_normalized_tensor(mean, std)
    )


# --------------------------------------------------------------------------------------------
# Reading image files: every kind of image as RGB, every unreadable file named.
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Loading ImageNet-style data from disk.
# --------------------------------------------------------------------------------------------


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


def _missing(path: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"no image data at {path.resolve()}: put ImageNet there as train/ and val/ class "
        f"folders (train/<class>/*.JPEG, val/<class>/*.JPEG), or run `python train.py` for the "
        f"quick start on generated data"
    )


def table_files(root: Path) -> tuple[str, list[Path]]:
    """(``"parquet"`` or ``"arrow"``, the files under ``root``): tables ``datasets`` reads as they
    are; ``("", [])`` when there are none (then ``root`` holds class folders)."""
    for kind in ("parquet", "arrow"):
        files = sorted(root.rglob(f"*.{kind}"))
        if files:
            return kind, files
    return "", []


def _hf_splits(root: Path, cache_dir: str | None, progress: bool) -> tuple[Any, Any]:
    import datasets  # heavy import, only when asked for

    kind, tables = table_files(root)
    with datasets_progress(progress):
        if tables:
            train = [str(p) for p in tables if "train" in p.relative_to(root).as_posix()]
            val = [str(p) for p in tables if "val" in p.relative_to(root).as_posix()]
            if not train or not val:
                raise _missing(root / ("train" if not train else "val"))
            files = {"train": train, "validation": val}
            splits = datasets.load_dataset(kind, data_files=files, cache_dir=cache_dir)
        else:
            check_class_folders(root)
            splits = datasets.load_dataset("imagefolder", data_dir=str(root), cache_dir=cache_dir)
    return splits["train"], splits["validation"]


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
        raise _missing(root)
    train_tf = train_transforms(image_size, scale, hflip, cutout)
    eval_tf = eval_transforms(image_size)
    if source == "hf":
        hf_train, hf_val = _hf_splits(root, cache_dir, progress)
        return (
            HFImageDataset(hf_train, train_tf, name=f"the train split of {root}"),
            HFImageDataset(hf_val, eval_tf, name=f"the val split of {root}"),
        )
    if source != "imagefolder":
        raise ValueError(f"source must be 'imagefolder' or 'hf', got {source!r}")
    from torchvision.datasets import ImageFolder

    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise _missing(root / split)
    check_class_folders(root)
    train = ImageFolder(root / "train", train_tf, loader=read_image)
    return train, ImageFolder(root / "val", eval_tf, loader=read_image)


def build_image_loader(
    dataset: Dataset[Any],
    batch_size: int,
    shuffle: bool = True,
    num_workers: int = 4,
    seed: int = 0,
    drop_last: bool = False,
) -> DataLoader[Any]:
    """A DataLoader with worker processes, pinned memory on CUDA machines and a seeded
    generator: the same seed gives the same order and the same random augmentations.

    Example::

        loader = build_image_loader(train, batch_size=128, shuffle=True, num_workers=8, seed=0)
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=num_workers > 0,
    )
