"""Generated images: shapes, determinism, learnability, and written as a PNG folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from giantpipe.data.images.folders import build_image_datasets
from giantpipe.data.images.generated import (
    GeneratedImages,
    generated_datasets,
    write_image_folder,
)


def test_generated_images_shape_dtype_and_labels() -> None:
    data = GeneratedImages(size=30, image_size=24, num_classes=10, seed=0)
    image, label = data[13]
    assert image.shape == (3, 24, 24) and image.dtype == torch.float32
    assert label.dtype == torch.int64 and label.item() == 3
    assert len(data) == 30
    assert [data[i][1].item() for i in range(10)] == list(range(10))
    with pytest.raises(IndexError):
        data[30]


def test_generated_images_are_deterministic_per_seed_and_index() -> None:
    a = GeneratedImages(size=8, image_size=32, seed=0)
    b = GeneratedImages(size=8, image_size=32, seed=0)
    c = GeneratedImages(size=8, image_size=32, seed=1)
    for i in range(8):
        assert torch.equal(a[i][0], b[i][0])
        assert not torch.equal(a[i][0], c[i][0])
    assert not torch.equal(a[0][0], a[1][0])
    # generated lazily: reading out of order gives the same tensors
    assert torch.equal(GeneratedImages(size=8, image_size=32, seed=0)[7][0], a[7][0])


def test_any_image_size() -> None:
    for size in (8, 33, 224):
        assert GeneratedImages(size=1, image_size=size)[0][0].shape == (3, size, size)


def test_classes_are_separable_by_a_nearest_mean_probe() -> None:
    """Class means fitted on seed 0 classify seed-1 images far above chance (0.1)."""
    train, held_out = generated_datasets(num_train=400, num_val=200, image_size=16)

    def features(data: GeneratedImages) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = zip(*(data[i] for i in range(len(data))), strict=True)
        x = torch.stack(images)
        # colour histogram-like features: per-channel mean and std, and a coarse 4x4 map
        pooled = torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)
        stats = torch.cat([x.mean(dim=(2, 3)), x.std(dim=(2, 3))], dim=1)
        return torch.cat([pooled, 4 * stats], dim=1), torch.stack(labels)

    x_train, y_train = features(train)
    x_test, y_test = features(held_out)
    means = torch.stack([x_train[y_train == c].mean(0) for c in range(10)])
    predicted = torch.cdist(x_test, means).argmin(dim=1)
    assert (predicted == y_test).float().mean().item() > 0.5


def test_write_image_folder_round_trip(tmp_path: Path) -> None:
    root = write_image_folder(
        tmp_path / "gen", num_train=12, num_val=8, image_size=32, num_classes=4
    )
    for split, count in (("train", 12), ("val", 8)):
        assert sorted(p.name for p in (root / split).iterdir()) == [f"class_{c}" for c in range(4)]
        assert len(list((root / split).glob("*/*.png"))) == count
    # pixels on disk are the generated image, rounded to 8 bits
    source = GeneratedImages(size=20, image_size=32, num_classes=4, seed=0)
    image, label = source.render(13)  # index 13 is the second validation image
    png = Image.open(root / "val" / f"class_{label}" / "0000013.png")
    on_disk = torch.tensor(list(png.convert("RGB").tobytes()), dtype=torch.float32)
    on_disk = on_disk.view(32, 32, 3).permute(2, 0, 1)
    assert torch.equal(on_disk, (image * 255).round())

    train, val = build_image_datasets(root, image_size=32)
    assert len(train) == 12 and len(val) == 8
    assert train.classes == val.classes == source.classes  # type: ignore[attr-defined]
    x, y = val[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 0
    assert train[5][0].shape == (3, 32, 32)
