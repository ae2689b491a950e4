"""The GPipe paper's image transforms: random-resized crop, flip and cutout for training; resize
by 256/224 and center crop for evaluation; both normalize with ImageNet's mean and deviation.

Example::

    from giantpipe.data.images.transforms import eval_transforms, train_transforms

    train_tf = train_transforms(224, cutout=56)
    tensor = eval_transforms(224)(pil_image)          # (3, 224, 224)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torchvision.transforms import v2


__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Cutout",
    "eval_transforms",
    "train_transforms",
]


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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
