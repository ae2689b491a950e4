"""Every recipe with every data option: it composes when the data fits the recipe's model, and is
refused naming a recipe to use when it does not (composition only, nothing trains). The schemas
the command line reads from source (their twins) say what the real ones say."""

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from giantpipe.cli import (
    check_config,
    check_fits,
    data_reads,
    option_schemas,
    option_twins,
    recipe_choices,
    register_configs,
    schema_twin,
)
from giantpipe.config import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
OPTIONS = sorted(p for g in ("model", "data") for p in (CONF / g).glob("*.yaml"))
NEEDS = {"tensors": ["data.root=.", "data.features=4", "data.classes=2"]}
"""What a data option cannot do without (its files), given so that the matrix composes."""


@pytest.fixture(scope="module")
def compose_with():
    register_configs(CONF)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda *overrides: compose("config", list(overrides), return_hydra_config=True)


def fits(recipe: str, data: str) -> bool:
    model = recipe_choices(CONF / "recipe" / f"{recipe}.yaml")["model"]
    reads = data_reads(yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text()))
    (twin,) = option_twins(CONF / "data" / f"{data}.yaml").values()
    return reads <= {f.name for f in dataclasses.fields(twin)}


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_composes_with_every_data_that_fits_and_refuses_the_rest(
    compose_with, recipe: str, data: str
):
    cfg = compose_with(f"recipe={recipe}", f"data={data}", *NEEDS.get(data, []))
    choices = dict(cfg.hydra.runtime.choices)
    del cfg.hydra
    if fits(recipe, data):
        check_fits(cfg, choices, CONF)
        experiment = check_config(cfg)
        assert experiment.name == recipe
        assert type(experiment.data).__name__ in option_twins(CONF / "data" / f"{data}.yaml")
    else:
        with pytest.raises(ConfigError, match=r"for this data use recipe=\w+") as refused:
            check_fits(cfg, choices, CONF)
        assert refused.value.key == f"data={data}"


def test_every_data_option_fits_some_recipe():
    assert all(any(fits(recipe, data) for recipe in RECIPES) for data in DATA if data != "tensors")
    assert fits("mlp_quickstart", "tensors")  # the README's data=tensors runs under this recipe


@pytest.mark.parametrize("option", OPTIONS, ids=lambda p: f"{p.parent.name}={p.stem}")
def test_the_twin_read_from_source_has_the_schemas_fields_types_and_defaults(option: Path):
    ((name, real),) = option_schemas(option).items()
    twin = option_twins(option)[name]
    assert typing.get_type_hints(twin) == typing.get_type_hints(real)
    assert [described(f) for f in dataclasses.fields(twin)] == [
        described(f) for f in dataclasses.fields(real)
    ]


def described(field: dataclasses.Field) -> tuple[str, object]:
    factory = field.default_factory
    return field.name, factory() if factory is not dataclasses.MISSING else field.default


@pytest.mark.parametrize("model", ["hf_causal_lm", "transformer_lm", "transformer_t"])
def test_a_language_model_on_feature_tensors_is_refused_naming_the_data_it_fits(
    compose_with, model: str
):
    """Their vocabulary and length follow the data (no silent default when the data has none)."""
    cfg = compose_with("recipe=mlp_quickstart", f"model={model}", "data=tensors", "data.root=.")
    choices = dict(cfg.hydra.runtime.choices)
    del cfg.hydra
    with pytest.raises(ConfigError, match=r"data\.vocab_size.*the model fits data=(lm_tokens|tr)"):
        check_fits(cfg, choices, CONF)


def test_a_twin_rebuilds_field_defaults_and_refuses_what_it_cannot_read(tmp_path: Path):
    source = tmp_path / "builder.py"
    source.write_text(
        "from dataclasses import dataclass, field\n\n@dataclass\nclass OptionConfig:\n"
        "    files: list[str] = field(default_factory=list)\n"
        "    sizes: list[int] = field(default_factory=lambda: [1, 2])\n"
        "    name: str = field(default='x')\n    seed: int | None = None\n"
    )
    twin = schema_twin(source, "OptionConfig")
    assert twin() == twin(files=[], sizes=[1, 2], name="x", seed=None)
    assert twin().sizes is not twin().sizes
    source.write_text(source.read_text() + "    width: int = WIDTH\n")
    with pytest.raises(ConfigError, match="OptionConfig.width must have a builtin type"):
        schema_twin(source, "OptionConfig")
