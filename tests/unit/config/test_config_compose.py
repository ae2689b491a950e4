"""The Hydra tree: every recipe and group option composes, converts and instantiates."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from giantpipe.cli.checks import to_experiment
from giantpipe.cli.errors import one_line
from giantpipe.cli.registration import register_configs
from giantpipe.config import SCHEMAS, ExperimentConfig
from giantpipe.data.bundle import DataBundle, batch_size
from giantpipe.data.images.generated import write_image_folder
from giantpipe.runner.build import build_model
from giantpipe.runner.registry import build_from_target

CONF = Path(__file__).resolve().parents[3] / "conf"
register_configs(CONF)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


OWN_SCHEMAS = ("model", "data")  # each option typed by the schema it names (cli/schemas.py)
FIXED = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "recipe")
FIXED = [g for g in FIXED if g not in OWN_SCHEMAS]
"""Every other group of conf/ (a folder) is typed by one schema of ``giantpipe.config``."""


def composed(*overrides: str) -> ExperimentConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_experiment(compose("config", overrides=list(overrides)))


def recipe_using(group: str, option: str) -> list[str]:
    """A recipe that picks ``group=option``, so the option's interpolations (a model's
    ``${data.num_classes}``) resolve against data of the right kind; none: the default job."""
    for path in sorted((CONF / "recipe").glob("*.yaml")):
        if f"override /{group}: {option}\n" in path.read_text():
            return [f"recipe={path.stem}"]
    return []


def data_overrides(option: str, tmp_path: Path) -> list[str]:
    """Values only a user can give (a data directory), for the options that need them."""
    if option == "images_folder":
        write_image_folder(tmp_path, num_train=16, num_val=4, image_size=32, num_classes=4)
        return [
            f"data.root={tmp_path}",
            "data.num_classes=4",
            "data.batch_size=4",
            "data.num_workers=0",
        ]
    if option == "text":
        paragraphs = [f"Paragraph {i}: the dog sees the cat near the river." for i in range(20)]
        (tmp_path / "a.txt").write_text("\n\n".join(paragraphs))
        files = f"data.files=[{tmp_path}/*.txt]"
        return [files, "data.seq_len=8", "data.batch_size=2", "data.vocab_size=60"]
    if option != "tensors":
        return []
    torch.save((torch.randn(128, 16), torch.randint(0, 8, (128,))), tmp_path / "train.pt")
    torch.save((torch.randn(8, 16), torch.randint(0, 8, (8,))), tmp_path / "eval.pt")
    return ["recipe=mlp_quickstart", f"data.root={tmp_path}", "data.features=16", "data.classes=8"]


@pytest.mark.parametrize("recipe", options("recipe"))
def test_every_recipe_composes_and_opens_with_command_hardware_number(recipe):
    cfg = composed(f"recipe={recipe}")
    assert cfg.name == recipe
    head = (CONF / "recipe" / f"{recipe}.yaml").read_text().splitlines()[:6]
    text = "\n".join(head)
    assert head[0] == "# @package _global_"
    for label in ("# Command:", "# Hardware:", "# Reproduces:"):
        assert label in text, f"{recipe}.yaml must open with a {label} line"


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in FIXED for o in options(g)])
def test_every_fixed_group_option_converts_to_its_schema(group, option):
    assert group in SCHEMAS, f"conf/{group}/ has no schema in giantpipe.config.SCHEMAS"
    cfg = composed(f"{group}={option}")
    assert isinstance(getattr(cfg, group), SCHEMAS[group])


@pytest.mark.slow
@pytest.mark.parametrize("option", options("model"))
def test_every_model_target_instantiates(option):
    cfg = composed(*recipe_using("model", option), f"model={option}")
    with torch.device("meta"):  # paper-sized models (557M parameters) without allocating them
        model = build_model(cfg)
    assert isinstance(model, torch.nn.Sequential) and len(model) > 0


@pytest.mark.slow
@pytest.mark.parametrize("option", options("data"))
def test_every_data_target_instantiates(option, tmp_path):
    overrides = data_overrides(option, tmp_path)
    if not any(o.startswith("recipe=") for o in overrides):
        overrides = recipe_using("data", option) + overrides
    cfg = composed(f"data={option}", *overrides)
    bundle = build_from_target(cfg.data, "data")
    assert isinstance(bundle, DataBundle)
    inputs, targets = next(bundle.train_batches(0, 0))
    assert batch_size(inputs) == batch_size(targets)  # inputs may be a tuple (source, target in)


def test_default_job_is_the_quickstart_on_two_cpu_stand_ins():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        raw = compose("config")
    assert OmegaConf.get_type(raw) is ExperimentConfig
    cfg = to_experiment(raw)
    assert cfg.name == "amoebanet_quickstart"
    assert (cfg.pipeline.devices, cfg.pipeline.num_devices) == ("cpu", 2)


def test_command_line_override_beats_recipe():
    assert composed("trainer.max_steps=7").trainer.max_steps == 7


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("pipeline.checkpoint=always", "pipeline.checkpoint: renamed to pipeline.recompute"),
        ("+pipeline.checkpoint=always", "pipeline.checkpoint: renamed to pipeline.recompute"),
        ("optim.schedule.name=cosine", "optim.schedule: renamed to optim.lr_schedule"),
        ("+optim.schedule.name=cosine", "optim.schedule: renamed to optim.lr_schedule"),
    ],
)
def test_a_renamed_key_is_one_line_naming_the_new_key(override, line):
    with pytest.raises(Exception) as info:
        composed(override)
    assert one_line(info.value) == line


@pytest.mark.parametrize(
    ("override", "near"),
    [
        ("recipe=mlp_quickstrat", "; did you mean recipe=mlp_quickstart?"),
        ("model=amoebanet_dd", "; did you mean model=amoebanet_d?"),
        ("optim=sdg", "; did you mean optim=sgd?"),
        ("model=resnet", ""),
    ],
)
def test_a_typo_in_a_groups_option_names_the_option_meant(override: str, near: str) -> None:
    with pytest.raises(Exception) as info:
        composed(override)
    line = one_line(info.value)
    assert line.startswith(f"{override}: no such option (available: ")
    assert line.endswith(")" + near)
