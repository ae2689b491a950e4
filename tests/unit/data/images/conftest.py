"""Shared by the image tests: one thread for tiny ops, and a small ImageNet-style folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.data.images.generated import write_image_folder


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="package")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 training and 12 validation PNGs of 4 classes in train/ and val/ class folders."""
    root = tmp_path_factory.mktemp("imagenet")
    return write_image_folder(root, num_train=40, num_val=12, image_size=32, num_classes=4)
