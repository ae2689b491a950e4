"""The paper's transforms: crop, flip and cutout to train; resize and center crop to evaluate."""

from __future__ import annotations

import torch
from PIL import Image

from giantpipe.data.images.transforms import Cutout, eval_transforms, train_transforms


def test_transforms_follow_the_paper() -> None:
    image = Image.new("RGB", (300, 200), color=(120, 60, 30))
    assert train_transforms(64)(image).shape == (3, 64, 64)
    assert eval_transforms(224)(image).shape == (3, 224, 224)
    names = [type(t).__name__ for t in train_transforms(64, cutout=16).transforms]
    assert names[:2] == ["RandomResizedCrop", "RandomHorizontalFlip"] and names[-1] == "Cutout"
    names = [type(t).__name__ for t in eval_transforms(224).transforms]
    assert names[:2] == ["Resize", "CenterCrop"]
    assert eval_transforms(224).transforms[0].size == [256]


def test_cutout_zeroes_one_square() -> None:
    torch.manual_seed(0)
    image = torch.ones(3, 64, 64)
    out = Cutout(16)(image)
    zeroed = (out == 0).all(dim=0)
    rows, cols = zeroed.any(dim=1).sum().item(), zeroed.any(dim=0).sum().item()
    assert 0 < rows <= 16 and 0 < cols <= 16 and zeroed.sum() == rows * cols
    assert torch.equal(image, torch.ones(3, 64, 64))  # input untouched
    assert torch.equal(Cutout(0)(image), image)
