"""ImageNet-style roots read as train and val data sets, by torchvision or Hugging Face datasets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.data.images.folders import build_image_datasets
from giantpipe.data.images.generated import write_image_folder


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
