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
import hashlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from torchvision.transforms import v2

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Cutout",
    "GeneratedImages",
    "HFImageDataset",
    "build_image_datasets",
    "build_image_loader",
    "eval_transforms",
    "generated_datasets",
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
# Loading ImageNet-style data from disk.
# --------------------------------------------------------------------------------------------


class HFImageDataset(Dataset[tuple[Any, int]]):
    """Wraps a HuggingFace ``datasets.Dataset`` with ``image`` and ``label`` columns.

    Example::

        hf = datasets.load_dataset("imagefolder", data_dir="data/imagenet")["train"]
        data = HFImageDataset(hf, transform=train_transforms(224))
    """

    def __init__(
        self,
        data: Any,
        transform: Callable[[Any], Any] | None = None,
        image_key: str = "image",
        label_key: str = "label",
    ) -> None:
        self.data, self.transform = data, transform
        self.image_key, self.label_key = image_key, label_key
        self.classes: list[str] = list(data.features[label_key].names)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        row = self.data[index]
        image = row[self.image_key].convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, int(row[self.label_key])


def _missing(path: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"no image data at {path.resolve()}: put ImageNet there as train/ and val/ class "
        f"folders (train/<class>/*.JPEG, val/<class>/*.JPEG), or run `python train.py` for the "
        f"quick start on generated data"
    )


def _hf_splits(root: Path, cache_dir: str | None) -> tuple[Any, Any]:
    import datasets  # heavy import, only when asked for

    parquet = sorted(root.rglob("*.parquet"))
    if parquet:
        train = [str(p) for p in parquet if "train" in p.relative_to(root).as_posix()]
        val = [str(p) for p in parquet if "val" in p.relative_to(root).as_posix()]
        if not train or not val:
            raise _missing(root / ("train" if not train else "val"))
        files = {"train": train, "validation": val}
        splits = datasets.load_dataset("parquet", data_files=files, cache_dir=cache_dir)
    else:
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise _missing(root / split)
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
) -> tuple[Dataset[Any], Dataset[Any]]:
    """Train and validation data sets from ``root``: ``train/`` and ``val/`` class folders read
    by torchvision ``ImageFolder`` (``source="imagefolder"``) or by HuggingFace ``datasets``
    (``source="hf"``: the same folders, or parquet files whose paths contain "train" / "val").
    Training uses :func:`train_transforms`, validation :func:`eval_transforms`.

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
        hf_train, hf_val = _hf_splits(root, cache_dir)
        return HFImageDataset(hf_train, train_tf), HFImageDataset(hf_val, eval_tf)
    if source != "imagefolder":
        raise ValueError(f"source must be 'imagefolder' or 'hf', got {source!r}")
    from torchvision.datasets import ImageFolder

    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise _missing(root / split)
    train, val = ImageFolder(root / "train", train_tf), ImageFolder(root / "val", eval_tf)
    if train.classes != val.classes:
        raise ValueError(f"train/ and val/ under {root} hold different class folders")
    return train, val


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
