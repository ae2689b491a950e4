"""Generated images, the ImageNet-style loaders and the paper's transforms."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from giantpipe.data.images import (
    Cutout,
    GeneratedImages,
    build_image_datasets,
    build_image_loader,
    eval_transforms,
    generated_datasets,
    train_transforms,
    write_image_folder,
)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


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


def test_hf_source_reads_the_same_folders_and_parquet(tmp_path: Path) -> None:
    root = write_image_folder(
        tmp_path / "gen", num_train=8, num_val=4, image_size=32, num_classes=4
    )
    cache = str(tmp_path / "cache")
    train, val = build_image_datasets(root, image_size=32, source="hf", cache_dir=cache)
    assert len(train) == 8 and len(val) == 4
    assert train.classes == [f"class_{c}" for c in range(4)]  # type: ignore[attr-defined]
    x, y = val[0]
    assert x.shape == (3, 32, 32) and isinstance(y, int)

    parquet = tmp_path / "parquet"
    parquet.mkdir()
    train.data.to_parquet(str(parquet / "train-00000.parquet"))  # type: ignore[attr-defined]
    val.data.to_parquet(str(parquet / "validation-00000.parquet"))  # type: ignore[attr-defined]
    train_pq, val_pq = build_image_datasets(parquet, image_size=32, source="hf", cache_dir=cache)
    assert len(train_pq) == 8 and len(val_pq) == 4  # type: ignore[arg-type]
    assert torch.equal(val_pq[1][0], val[1][0])


@pytest.mark.parametrize("source", ["imagefolder", "hf"])
def test_missing_data_names_the_path_in_one_line(tmp_path: Path, source: str) -> None:
    missing = tmp_path / "imagenet"
    with pytest.raises(FileNotFoundError) as info:
        build_image_datasets(missing, source=source)  # type: ignore[arg-type]
    message = str(info.value)
    assert str(missing) in message and "\n" not in message
    assert "train/" in message and "val/" in message and "python train.py" in message

    (missing / "train").mkdir(parents=True)  # val/ still missing
    with pytest.raises(FileNotFoundError, match=str(missing / "val")):
        build_image_datasets(missing, source=source)  # type: ignore[arg-type]


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


def test_loader_order_is_seeded_and_workers_agree() -> None:
    data = GeneratedImages(size=24, image_size=16, num_classes=4, seed=0)

    def labels(seed: int, workers: int) -> list[int]:
        loader = build_image_loader(
            data, batch_size=8, shuffle=True, num_workers=workers, seed=seed
        )
        return [y for _, batch in loader for y in batch.tolist()]

    assert labels(0, 0) == labels(0, 0)
    assert labels(0, 0) != labels(1, 0)
    assert labels(0, 2) == labels(0, 0)
    images, batch = next(iter(build_image_loader(data, 5, shuffle=False, num_workers=0)))
    assert images.shape == (5, 3, 16, 16) and batch.dtype == torch.int64
