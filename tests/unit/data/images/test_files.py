"""Image folders as a user brings them: a PNG tree with grey, odd-sized, 16-bit, truncated and
non-image files, read by torchvision's ImageFolder and by HuggingFace datasets (folders and
parquet) with loader workers. Unreadable files are named or skipped and counted; a missing or
empty class folder names the split and the class; datasets' bars follow logger.progress."""

from __future__ import annotations

import itertools
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from giantpipe.config import ConfigError
from giantpipe.data.images.bundle import image_folder
from giantpipe.data.images.files import UnreadableImage, read_image
from giantpipe.data.images.generated import write_image_folder
from giantpipe.data.images.hf import datasets_progress

SOURCES = ["imagefolder", "hf"]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    import tqdm

    torch.set_num_threads(1)
    # datasets' progress bars would leave tqdm's monitor thread running for the whole session.
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 training and 12 validation PNGs of 4 classes, plus a grey 70x50 and a 16-bit grey
    image of another size: every file readable."""
    root = write_image_folder(
        tmp_path_factory.mktemp("photos"), num_train=40, num_val=12, num_classes=4
    )
    grey = np.linspace(0, 255, 70 * 50).reshape(50, 70).astype(np.uint8)
    Image.fromarray(grey, "L").save(root / "train" / "class_0" / "grey.png")
    deep = (np.linspace(0, 65535, 20 * 30).reshape(30, 20)).astype(np.uint16)
    Image.fromarray(deep).save(root / "val" / "class_1" / "grey16.png")
    return root


def with_bad_file(clean: Path, tmp_path: Path, kind: str, split: str = "train") -> Path:
    """A copy of ``clean`` with one unreadable file in ``split``/class_1 (returned)."""
    root = tmp_path / "photos"
    shutil.copytree(clean, root)
    bad = root / split / "class_1" / f"{kind}.png"
    if kind == "truncated":
        whole = next((root / split / "class_1").glob("0*.png")).read_bytes()
        bad.write_bytes(whole[: len(whole) // 2])
    else:
        bad.write_text("not a picture at all")
    return bad


def build(root: Path, source: str, tmp_path: Path, **extra):
    options = dict(num_classes=4, image_size=24, batch_size=8, num_workers=2, progress="none")
    return image_folder(
        str(root), source=source, cache_dir=str(tmp_path / "hf"), **{**options, **extra}
    )


def one_epoch(bundle) -> list:
    return list(itertools.islice(bundle.train_batches(0, 0), bundle.batches_per_epoch))


# -- grey and colour images of any size ------------------------------------------------------


def test_grey_and_16_bit_images_read_as_rgb_of_their_size(clean: Path) -> None:
    grey = read_image(clean / "train" / "class_0" / "grey.png")
    deep = read_image(clean / "val" / "class_1" / "grey16.png")
    assert (grey.mode, grey.size, deep.mode, deep.size) == ("RGB", (70, 50), "RGB", (20, 30))
    assert deep.getextrema()[0] == (0, 255)  # scaled from 16 bits, not clipped at 255


@pytest.mark.parametrize("source", SOURCES)
def test_every_image_comes_out_rgb_at_the_recipe_size(clean, tmp_path, source) -> None:
    bundle = build(clean, source, tmp_path)
    assert all(x.shape == (8, 3, 24, 24) for x, _ in one_epoch(bundle))
    evaluated = list(bundle.eval_batches())
    assert sum(len(y) for _, y in evaluated) == 13 and evaluated[0][0].shape[1:] == (3, 24, 24)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_parquet_and_arrow_tables_train_with_their_classes(clean, tmp_path, kind) -> None:
    import datasets

    with datasets_progress(False):
        loaded = datasets.load_dataset("imagefolder", data_dir=str(clean), cache_dir=str(tmp_path))
    for split, name in (("train", "train"), ("validation", "val")):
        if kind == "parquet":
            loaded[split].to_parquet(tmp_path / kind / f"{name}.parquet")
        else:
            loaded[split].save_to_disk(tmp_path / kind / name)  # data-00000-of-00001.arrow
    bundle = build(tmp_path / kind, "hf", tmp_path)
    assert all(x.shape == (8, 3, 24, 24) for x, _ in one_epoch(bundle))
    assert sum(len(y) for _, y in bundle.eval_batches()) == 13


# -- unreadable files: named, or skipped and counted -------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(
    ("kind", "reason"),
    [("truncated", "image file is truncated"), ("text", "not an image format PIL knows")],
)
def test_an_unreadable_image_in_a_worker_is_named(clean, tmp_path, source, kind, reason) -> None:
    bad = with_bad_file(clean, tmp_path, kind)
    with pytest.raises(ConfigError) as err:
        one_epoch(build(bad.parents[2], source, tmp_path))
    assert str(err.value).startswith(f"data.root: {bad}: not a readable image ({reason}")
    assert str(err.value).endswith(
        "; remove it, or set data.skip_bad_files=true to skip and count such files"
    )


@pytest.mark.parametrize("source", SOURCES)
def test_skip_bad_files_skips_counts_and_lists_them(clean, tmp_path, source, caplog) -> None:
    bad_train = with_bad_file(clean, tmp_path, "truncated")
    bad_val = bad_train.parents[2] / "val" / "class_2" / "text.png"
    bad_val.write_text("not a picture")
    bundle = build(bad_train.parents[2], source, tmp_path, skip_bad_files=True, batch_size=6)
    with caplog.at_level(logging.WARNING, logger="giantpipe.data.images.files"):
        seen = sum(len(y) for _, y in one_epoch(bundle))  # 42 images: 7 batches of 6
        evaluated = sum(len(y) for _, y in bundle.eval_batches())
    assert (seen, evaluated) == (41, 13)
    assert f"skipped unreadable image {bad_train} (image file is truncated" in caplog.text
    assert f"skipped unreadable image {bad_val} (not an image format PIL knows): 2 skipped" in (
        caplog.text
    )


def test_an_unreadable_image_without_a_path_names_its_row(tmp_path: Path) -> None:
    """Parquet files hold image bytes, often without the file they came from."""
    import datasets

    from giantpipe.data.images.hf import HFImageDataset

    Image.new("RGB", (9, 7), "red").save(tmp_path / "a.png")
    good = {"bytes": (tmp_path / "a.png").read_bytes(), "path": None}
    features = {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    rows = {"image": [good, {"bytes": b"garbage", "path": None}], "label": [0, 1]}
    data = HFImageDataset(
        datasets.Dataset.from_dict(rows, features=datasets.Features(features)), name="val.parquet"
    )
    assert data[0][0].size == (9, 7)
    with pytest.raises(UnreadableImage, match=r"^row 2 of val.parquet: not a readable image"):
        data[1]


# -- class folders: a missing or empty one names the split and the class -----------------------


@pytest.mark.parametrize("source", SOURCES)
def test_a_class_missing_from_val_names_the_split_and_class(clean, tmp_path, source) -> None:
    root = tmp_path / "photos"
    shutil.copytree(clean, root)
    shutil.rmtree(root / "val" / "class_3")
    with pytest.raises(ConfigError) as err:
        build(root, source, tmp_path)
    assert str(err.value) == (
        f"data.root: {root / 'val'} has no folder for class 'class_3' (train/class_3 exists); "
        "every class needs a folder in train/ and in val/"
    )


@pytest.mark.parametrize("source", SOURCES)
def test_an_empty_class_folder_names_the_split_and_class(clean, tmp_path, source) -> None:
    root = tmp_path / "photos"
    shutil.copytree(clean, root)
    for image in (root / "train" / "class_2").iterdir():
        image.unlink()
    (root / "train" / "class_2" / "notes.txt").write_text("no images here")
    with pytest.raises(ConfigError) as err:
        build(root, source, tmp_path)
    assert str(err.value).startswith(
        f"data.root: {root / 'train' / 'class_2'} holds no images (.jpg, .jpeg, .png"
    )
    assert str(err.value).endswith("class 'class_2' of train/ is empty; add its images or remove "
                                   "its folders")  # fmt: skip


def test_a_wrong_class_count_lists_the_classes_found(clean, tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        build(clean, "imagefolder", tmp_path, num_classes=10)
    assert str(err.value) == (
        f"data.num_classes: is 10 but {clean} holds 4 classes (class_0, class_1, class_2, "
        "class_3); set data.num_classes=4"
    )


# -- datasets' progress bars follow logger.progress -------------------------------------------


@pytest.mark.parametrize(("progress", "shown"), [("none", False), ("tqdm", True)])
def test_datasets_bars_follow_logger_progress(clean, tmp_path, capfd, progress, shown) -> None:
    build(clean, "hf", tmp_path, progress=progress, num_workers=0)
    err = capfd.readouterr().err
    assert ("Generating train split" in err) is shown, err
