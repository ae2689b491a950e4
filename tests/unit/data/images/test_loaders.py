"""Image loaders: a seeded order that workers agree on, a resumable sampler that covers an epoch,
augmentations seeded per image."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from giantpipe.data.images.generated import GeneratedImages
from giantpipe.data.images.loaders import (
    EpochBatches,
    SeededTransforms,
    build_image_loader,
    sample_seed,
)
from giantpipe.data.images.transforms import train_transforms


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


def test_epoch_batches_cover_every_image_once_per_epoch_and_resume() -> None:
    batches = list(itertools.islice(iter(EpochBatches(30, 8, seed=1, position=0)), 6))
    first_epoch = [i for batch in batches[:3] for _, i in batch]
    assert len(set(first_epoch)) == 24  # 3 full batches, the last 6 images dropped
    resumed = list(itertools.islice(iter(EpochBatches(30, 8, seed=1, position=4)), 2))
    assert resumed == batches[4:6]
    # The same image gets another augmentation seed in another epoch.
    assert sample_seed(1, 0, 5) != sample_seed(1, 1, 5)


def test_seeded_transforms_repeat_and_leave_the_global_rng_alone(folder: Path) -> None:
    from torchvision.datasets import ImageFolder

    data = SeededTransforms(ImageFolder(folder / "train", train_transforms(24, cutout=8)))
    state = torch.get_rng_state()
    a, _ = data[(123, 0)]
    b, _ = data[(123, 0)]
    c, _ = data[(124, 0)]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), state)
