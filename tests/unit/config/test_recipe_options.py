"""A recipe never silently overrides a group the user chose on the command line: what it sets for
one option of a group lives in conf/recipe/RECIPE/GROUP/OPTION.yaml and holds only with that
option; the recipe file itself sets only the keys that hold whatever the options (README)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from giantpipe.cli.checks import to_experiment
from giantpipe.cli.registration import OPTION_SCHEMAS, register_configs
from giantpipe.cli.schemas import option_schemas
from giantpipe.config import SCHEMAS, OptimConfig, PipelineConfig

CONF = Path(__file__).resolve().parents[3] / "conf"
register_configs(CONF)

TUNED = tuple(
    key.removeprefix("optional recipe@")
    for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    if isinstance(entry, dict)
    for key in entry
    if key.startswith("optional recipe@")
)
"""Groups whose options a recipe may tune, each in its own file: those config.yaml layers a
recipe's file over (``optional recipe@GROUP: ${recipe}/GROUP/${GROUP}``)."""
CARRIED = {"name", "trainer", "sweep", "data.image_size", "data.batch_size", "data.num_classes"}
"""What a recipe file sets for every option alike: the README lists exactly these."""
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def raw(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def own_choice(recipe: str, group: str) -> str:
    defaults = OmegaConf.load(CONF / "recipe" / f"{recipe}.yaml")["defaults"]
    (choice,) = [d[f"override /{group}"] for d in defaults if f"override /{group}" in d]
    return str(choice)


def as_it_is(group: str, option: str) -> dict:
    """``conf/GROUP/OPTION.yaml`` over its schema, interpolations unresolved: the option alone."""
    path = CONF / group / f"{option}.yaml"
    body = OmegaConf.load(path)
    schemas = option_schemas(path) if group in ("model", "data") else {"": SCHEMAS[group]}
    (schema,) = schemas.values()
    merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.masked_copy(body, [
        k for k in body if k != "defaults"
    ]))  # fmt: skip
    return OmegaConf.to_container(merged, resolve=False)  # type: ignore[return-value]


def without_carried(group: str, values: dict) -> dict:
    return {k: v for k, v in values.items() if f"{group}.{k}" not in CARRIED}


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_file_sets_only_the_keys_every_option_shares(recipe: str) -> None:
    body = OmegaConf.load(CONF / "recipe" / f"{recipe}.yaml")
    keys = {k for k in body if k != "defaults" and k not in TUNED}
    keys |= {f"{g}.{k}" for g in TUNED if g in body for k in body[g]}
    assert keys - CARRIED == set(), f"{recipe}.yaml: move these into {recipe}/GROUP/OPTION.yaml"


def test_every_tuning_file_names_a_recipe_a_group_and_one_of_its_options() -> None:
    files = sorted((CONF / "recipe").glob("*/*/*.yaml"))
    assert len(files) > 10
    for path in files:
        recipe, group, option = path.relative_to(CONF / "recipe").with_suffix("").parts
        assert recipe in RECIPES and group in TUNED and option in options(group), path
    assert not list((CONF / "recipe").glob("*/*.yaml")), "GROUP/OPTION.yaml, one level deeper"


@pytest.mark.slow
@pytest.mark.parametrize("group", TUNED)
@pytest.mark.parametrize("recipe", RECIPES)
def test_another_option_chosen_on_the_command_line_is_taken_as_it_is(recipe, group) -> None:
    for option in options(group):
        tuned = (CONF / "recipe" / recipe / group / f"{option}.yaml").is_file()
        if option == own_choice(recipe, group) or tuned:  # the recipe's settings, said openly
            continue
        try:
            chosen = raw(f"recipe={recipe}", f"{group}={option}")[group]
        except Exception as err:  # noqa: BLE001 - only a carried key may not fit the option
            carried = [k for k in CARRIED if k.startswith("data.") and k[5:] in str(err)]
            assert group == "data" and carried, (recipe, option, err)
            continue
        got = OmegaConf.to_container(chosen, resolve=False)
        assert without_carried(group, got) == without_carried(group, as_it_is(group, option))


def test_the_imagenet_recipe_on_cpu_k2_runs_on_cpu_k2() -> None:
    """The recipe's K=4, M=32 by time stay with pipeline=auto; cpu_k2 is cpu_k2."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_experiment(compose("config", ["recipe=amoebanet_imagenet", "pipeline=cpu_k2"]))
    assert cfg.pipeline == PipelineConfig(**OmegaConf.load(CONF / "pipeline" / "cpu_k2.yaml"))
    paper = to_experiment(raw("recipe=amoebanet_imagenet"))
    assert (paper.pipeline.num_devices, paper.pipeline.chunks) == (4, 32)


def test_another_optimizer_gets_its_own_rate() -> None:
    cfg = to_experiment(raw("recipe=amoebanet_imagenet", "optim=adamw"))
    adamw = OmegaConf.merge(OmegaConf.structured(OptimConfig), as_it_is("optim", "adamw"))
    assert cfg.optim == OmegaConf.to_object(adamw) and cfg.optim.lr == 3e-3


def test_the_quickstart_on_your_folder_keeps_its_size_and_takes_folder_settings() -> None:
    cfg = raw("recipe=amoebanet_quickstart", "data=images_folder", "data.root=DIR")
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(data, dict)
    assert (data["image_size"], data["batch_size"], data["num_classes"]) == (32, 64, 10)
    assert (data["num_workers"], data["min_scale"], data["root"]) == (2, 0.35, "DIR")
    assert "train_size" not in data  # the generated images' size stays with them
    assert OPTION_SCHEMAS["ImageFolderDataConfig"]  # typed by the folder option's schema


def test_the_docs_commands_for_your_own_data_compose_as_typed() -> None:
    import re
    import shlex

    doc = (CONF.parent / "docs" / "your-data.md").read_text()
    sections = doc.split("\n## ")[1:3]  # Images, A parallel corpus
    blocks = [re.search(r"```bash\n(.*?)```", s, re.S) for s in sections]
    assert all(blocks), "docs/your-data.md: Images and corpus need a bash block each"
    lines = [ln for b in blocks if b for ln in b.group(1).replace("\\\n", " ").splitlines()]
    commands = [ln for ln in lines if ln.startswith("python train.py")]
    assert len(commands) == 2
    for command in commands:
        words = shlex.split(command)
        assert words[:2] == ["python", "train.py"]
        cfg = to_experiment(raw(*words[2:]))
        assert cfg.name in ("amoebanet_quickstart", "transformer_quickstart")
