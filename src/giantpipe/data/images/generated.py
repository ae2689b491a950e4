"""Generated textured images: a learnable classification data set rendered from (seed, index),
no files, and the same images written as an ImageNet-style PNG folder.

Example::

    from giantpipe.data.images.generated import GeneratedImages, write_image_folder

    train = GeneratedImages(size=2048, image_size=32, num_classes=10, seed=0)
    image, label = train[3]                  # (3, 32, 32) float32 normalized, tensor(3) int64
    write_image_folder("photos", num_train=200, num_val=50)   # photos/{train,val}/<class>/*.png
"""

from __future__ import annotations

import colorsys
import hashlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from giantpipe.data.images.transforms import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "GeneratedImages",
    "generated_datasets",
    "write_image_folder",
]


_GOLDEN = 0.6180339887498949
_FAMILIES = ("stripes", "checkerboard", "rings", "dots", "waves")


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
