"""Every recipe with every data option: it composes when the data fits the recipe's model, and is
refused naming a recipe to use when it does not (composition only, nothing trains)."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from giantpipe.cli.checks import check_config, check_fits, data_reads, recipe_choices
from giantpipe.cli.registration import register_configs
from giantpipe.cli.schemas import option_schemas
from giantpipe.config import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
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
    (schema,) = option_schemas(CONF / "data" / f"{data}.yaml").values()
    return reads <= {f.name for f in dataclasses.fields(schema)}


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
        assert type(experiment.data).__name__ in option_schemas(CONF / "data" / f"{data}.yaml")
    else:
        with pytest.raises(ConfigError, match=r"for this data use recipe=\w+") as refused:
            check_fits(cfg, choices, CONF)
        assert refused.value.key == f"data={data}"


def test_every_data_option_fits_some_recipe():
    assert all(any(fits(recipe, data) for recipe in RECIPES) for data in DATA if data != "tensors")
    assert fits("mlp_quickstart", "tensors")  # the README's data=tensors runs under this recipe


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
