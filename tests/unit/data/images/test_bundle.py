"""Image DataBundles: generated, random and ImageNet-style folders, resumable to the batch."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from giantpipe.config import ConfigError
from giantpipe.data.bundle import DataBundle
from giantpipe.data.images.bundle import generated_images, image_folder, random_images


def take(bundle: DataBundle, seed: int, position: int, count: int) -> list:
    return list(itertools.islice(bundle.train_batches(seed, position), count))


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_generated_images_batches_shapes_and_metric() -> None:
    bundle = generated_images(
        image_size=16, num_classes=5, train_size=64, eval_size=20, batch_size=8
    )
    images, labels = next(bundle.train_batches(0, 0))
    assert images.shape == (8, 3, 16, 16) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and int(labels.max()) < 5
    assert bundle.batches_per_epoch == 8 and bundle.metric == "top5"
    assert sum(len(y) for _, y in bundle.eval_batches()) == 20


def test_generated_stream_is_a_pure_function_of_seed_and_position() -> None:
    bundle = generated_images(image_size=8, train_size=40, eval_size=4, batch_size=8)
    whole = take(bundle, seed=3, position=0, count=12)  # 5 per epoch: crosses two epochs
    assert_same_batches(take(bundle, seed=3, position=7, count=5), whole[7:])
    assert not torch.equal(take(bundle, seed=4, position=0, count=1)[0][1], whole[0][1])
    epoch = torch.cat([x for x, _ in whole[:5]]).flatten(1)
    assert len(torch.unique(epoch, dim=0)) == 40  # one epoch shows each of the 40 images once


def test_random_images_repeat_one_batch() -> None:
    bundle = random_images(image_size=32, num_classes=7, batch_size=4, epoch_size=100)
    a, b = take(bundle, 0, 0, 2)
    assert a[0].shape == (4, 3, 32, 32) and int(a[1].max()) < 7
    assert torch.equal(a[0], b[0]) and bundle.batches_per_epoch == 25


def test_image_folder_batches_eval_and_classes(folder: Path) -> None:
    bundle = image_folder(str(folder), num_classes=4, image_size=24, batch_size=8, num_workers=0)
    images, labels = next(bundle.train_batches(0, 0))
    assert images.shape == (8, 3, 24, 24) and labels.dtype == torch.int64
    assert bundle.batches_per_epoch == 5 and bundle.metric == "top5"
    evaluated = list(bundle.eval_batches())
    assert sum(len(y) for _, y in evaluated) == 12 and evaluated[0][0].shape[-1] == 24


@pytest.mark.parametrize("workers", [0, 2])
def test_image_folder_stream_resumes_exactly_with_augmentation(folder: Path, workers: int) -> None:
    def bundle() -> DataBundle:
        return image_folder(
            str(folder), num_classes=4, image_size=24, batch_size=8, cutout=6, num_workers=workers
        )

    whole = take(bundle(), seed=0, position=0, count=7)  # 5 per epoch
    assert_same_batches(take(bundle(), seed=0, position=4, count=3), whole[4:])
    if workers:  # which process loads an image does not change its augmentation
        in_process = image_folder(
            str(folder), num_classes=4, image_size=24, batch_size=8, cutout=6, num_workers=0
        )
        assert_same_batches(take(in_process, seed=0, position=0, count=2), whole[:2])


def test_missing_directory_is_one_line_naming_key_path_and_way_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        image_folder(str(tmp_path / "imagenet"), num_classes=4)
    message = str(err.value)
    assert message.startswith(f"data.root: no image data at {tmp_path / 'imagenet'}")
    assert "train/ and val/ class folders" in message and "python train.py" in message
    assert "\n" not in message


def test_missing_val_split_names_it(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "train").symlink_to(folder / "train")
    with pytest.raises(ConfigError, match=f"no image data at {tmp_path / 'val'}"):
        image_folder(str(tmp_path), num_classes=4)


def test_wrong_class_count_names_data_num_classes(folder: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.num_classes: is 1000 but .* holds 4 classes"):
        image_folder(str(folder), num_classes=1000, num_workers=0)


def test_huggingface_imagefolder_gives_the_same_kind_of_batches(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("datasets")
    import tqdm

    # datasets' progress bars would leave tqdm's monitor thread running for the whole session.
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    bundle = image_folder(
        str(folder),
        num_classes=4,
        image_size=24,
        batch_size=8,
        source="hf",
        num_workers=0,
        cache_dir=str(tmp_path / "cache"),
    )
    images, labels = next(bundle.train_batches(0, 0))
    assert images.shape == (8, 3, 24, 24) and labels.dtype == torch.int64
    assert_same_batches(take(bundle, 0, 3, 1), take(bundle, 0, 0, 4)[3:])
