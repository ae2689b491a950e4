"""The AmoebaNet recipes end to end: composition, the ImageNet recipe without and with (tiny,
generated) data, fine-tuning to another class count, and the quick start as a new user runs it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from giantpipe.cli.checks import to_experiment
from giantpipe.cli.registration import register_configs
from giantpipe.config import ExperimentConfig
from giantpipe.data.images.generated import write_image_folder
from tests.support.train import REPO, train

register_configs(REPO / "conf")

# The ImageNet recipe scaled down to seconds: everything else (RMSProp TF-style, EMA, label
# smoothing, clipping, deferred BN, the ImageFolder pipeline) stays as the recipe sets it.
TINY_IMAGENET = [
    "recipe=amoebanet_imagenet",
    "model.num_layers=3",
    "model.num_filters=8",
    "data.image_size=32",
    "data.batch_size=8",
    "data.num_workers=0",
    "pipeline.devices=cpu",
    "pipeline.num_devices=2",
    "pipeline.chunks=2",
    "pipeline.balance=params",
    "trainer.max_epochs=null",
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "logger.progress=none",
]


def composed(*overrides: str) -> ExperimentConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_experiment(compose("config", overrides=list(overrides)))


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# -- composition ------------------------------------------------------------------------------


def test_the_default_job_is_the_amoebanet_quickstart():
    cfg = composed()
    assert cfg.name == "amoebanet_quickstart"
    assert (cfg.model.genotype, cfg.model.num_layers, cfg.model.num_filters) == ("D", 3, 16)
    assert cfg.model.num_classes == cfg.data.num_classes == 10
    assert (cfg.pipeline.devices, cfg.pipeline.num_devices) == ("cpu", 2)


def test_imagenet_recipe_has_the_paper_and_tf_reference_settings():
    cfg = composed("recipe=amoebanet_imagenet")
    model, data, optim, trainer = cfg.model, cfg.data, cfg.optim, cfg.trainer
    assert (model.genotype, model.num_layers, model.num_filters) == ("B", 18, 512)
    assert model.image_size == data.image_size == 480 and model.num_classes == 1000
    assert (model.bn_momentum, model.bn_eps, model.drop_path) == (3e-4, 1e-3, 0.3)
    assert (cfg.pipeline.num_devices, cfg.pipeline.deferred_batch_norm) == (4, True)
    assert (optim.name, optim.alpha, optim.momentum, optim.eps) == ("rmsprop", 0.9, 0.9, 1.0)
    assert optim.lr == pytest.approx(0.015 * data.batch_size / 32)  # TF: 0.015 per 32 images
    assert optim.weight_decay == 4e-5
    schedule = optim.lr_schedule
    assert (schedule.name, schedule.decay_rate, schedule.decay_epochs) == ("exponential", 0.97, 2.4)
    assert schedule.warmup_epochs == 3
    assert (trainer.label_smoothing, trainer.grad_clip, trainer.ema_decay) == (0.1, 10.0, 0.9999)


def test_speed_recipe_takes_k_and_m_as_overrides():
    cfg = composed("recipe=amoebanet_d_speed", "pipeline.num_devices=4", "pipeline.chunks=32")
    assert (cfg.model.genotype, cfg.model.num_layers, cfg.model.num_filters) == ("D", 18, 256)
    assert cfg.data.image_size == 224 and cfg.optim.name == "sgd"
    assert (cfg.pipeline.num_devices, cfg.pipeline.chunks) == (4, 32)
    assert cfg.sweep.objective == "train/samples_per_s"


# -- the ImageNet recipe ----------------------------------------------------------------------


@pytest.mark.slow
def test_imagenet_recipe_without_data_is_one_line_saying_where_it_goes(tmp_path: Path):
    result = train("recipe=amoebanet_imagenet", cwd=tmp_path)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: data.root: no image data at {tmp_path / 'data/imagenet'}")
    assert "train/ and val/ class folders" in lines[0] and "python train.py" in lines[0]


@pytest.fixture(scope="module")
def imagenet_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 steps of the (tiny) ImageNet recipe on a generated 4-class ImageFolder."""
    root = tmp_path_factory.mktemp("amoeba")
    write_image_folder(root / "data", num_train=32, num_val=8, image_size=32, num_classes=4)
    run_dir = root / "run"
    args = [f"data.root={root / 'data'}", "data.num_classes=4", f"hydra.run.dir={run_dir}"]
    ok(train(*TINY_IMAGENET, *args, cwd=root))
    return run_dir


@pytest.mark.slow
def test_imagenet_recipe_trains_from_an_image_folder(imagenet_run: Path):
    figures = summary(imagenet_run)
    assert figures["status"] == "completed" and figures["steps"] == 3
    assert 0.0 <= figures["eval/accuracy"] <= figures["eval/top5"] <= 1.0
    assert len(figures["pipeline/balance"]) == len(figures["pipeline/peak_memory_bytes"]) == 2


@pytest.mark.slow
def test_fine_tune_to_another_class_count(imagenet_run: Path, tmp_path: Path):
    write_image_folder(tmp_path / "data", num_train=24, num_val=6, image_size=32, num_classes=3)
    run_dir = tmp_path / "run"
    ok(
        train(
            *TINY_IMAGENET,
            f"data.root={tmp_path / 'data'}",
            "data.num_classes=3",
            f"trainer.init_from={imagenet_run / 'last'}",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
        )
    )
    assert summary(run_dir)["steps"] == 3
    log = (run_dir / "train.log").read_text()
    assert "freshly initialized: classifier.fc.bias, classifier.fc.weight" in log


@pytest.mark.slow
def test_fine_tune_from_a_foreign_checkpoint_is_one_line(tmp_path: Path):
    import torch

    torch.save({"encoder.weight": torch.zeros(2, 2)}, tmp_path / "other.pt")
    # balance by parameters: balance_by_time may warn of noisy timings on a busy machine
    args = [
        "data.train_size=64",
        "data.eval_size=16",
        "trainer.max_steps=1",
        "pipeline.balance=params",
    ]
    result = train(*args, f"trainer.init_from={tmp_path / 'other.pt'}", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: trainer.init_from: {tmp_path / 'other.pt'} has no tensor")


# -- the quick start on your images -----------------------------------------------------------

# The quick start as README "Your own data" types it, cut to 2 steps (no profiling).
QUICK_ON_FOLDER = [
    "recipe=amoebanet_quickstart",
    "data=images_folder",
    "data.batch_size=16",
    "pipeline.balance=params",
    "trainer.max_steps=2",
    "trainer.eval_every=2",
    "trainer.predict=false",
    "logger.progress=none",
]


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's 10-class photo folder: PNGs, every 3rd one grey, every 5th one 45 x 29 px."""
    from PIL import Image

    root = write_image_folder(tmp_path_factory.mktemp("photos"), num_train=60, num_val=20)
    for index, path in enumerate(sorted(root.rglob("*.png"))):
        image = Image.open(path)
        image = image.convert("L") if index % 3 == 0 else image
        (image.resize((45, 29)) if index % 5 == 0 else image).save(path)
    return root


@pytest.mark.slow
def test_the_quick_start_trains_on_your_image_folder(photos: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    ok(train(*QUICK_ON_FOLDER, f"data.root={photos}", f"hydra.run.dir={run_dir}", cwd=tmp_path))
    figures = summary(run_dir)
    assert figures["status"] == "completed" and figures["steps"] == 2
    assert 0.0 <= figures["eval/accuracy"] <= figures["eval/top5"] <= 1.0


@pytest.mark.slow
def test_the_quick_start_reads_parquet_through_datasets(photos: Path, tmp_path: Path):
    import datasets

    loaded = datasets.load_dataset("imagefolder", data_dir=str(photos), cache_dir=str(tmp_path))
    loaded["train"].to_parquet(tmp_path / "tables" / "train.parquet")
    loaded["validation"].to_parquet(tmp_path / "tables" / "val.parquet")
    run_dir = tmp_path / "run"
    args = [f"data.root={tmp_path / 'tables'}", "data.source=hf", f"hydra.run.dir={run_dir}"]
    result = ok(train(*QUICK_ON_FOLDER, *args, cwd=tmp_path))
    assert summary(run_dir)["steps"] == 2
    assert "Generating train split" not in result.stderr  # logger.progress=none: no bars


@pytest.mark.slow
def test_an_unreadable_image_stops_the_run_with_one_line_naming_it(photos, tmp_path: Path):
    import shutil

    root = tmp_path / "photos"
    shutil.copytree(photos, root)
    bad = root / "train" / "class_3" / "scan.png"
    bad.write_bytes((root / "train" / "class_3" / "0000003.png").read_bytes()[:200])
    # Batches of 10 over 61 images: in 7 steps each image is read (the last partial batch of an
    # epoch is dropped, another one in the next epoch).
    steps = ["data.batch_size=10", "trainer.max_steps=7"]
    args = [f"data.root={root}", *steps, f"hydra.run.dir={tmp_path / 'run'}"]
    result = train(*QUICK_ON_FOLDER, *args, cwd=tmp_path)  # two loader workers
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"error: data.root: {bad}: not a readable image (image file is truncated); remove it, "
        "or set data.skip_bad_files=true to skip and count such files"
    ], result.stderr
    run_dir = tmp_path / "skipping"
    ok(train(*QUICK_ON_FOLDER, *args[:3], "data.skip_bad_files=true", f"hydra.run.dir={run_dir}",
             cwd=tmp_path))  # fmt: skip
    assert f"skipped unreadable image {bad} (image file is truncated)" in (
        (run_dir / "train.log").read_text()
    )


# The default job with no arguments (the quick start) is run as typed by
# tests/integration/test_readme.py::test_main_job_command_runs_as_written.
