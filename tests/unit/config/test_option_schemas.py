"""Option schemas: found from conf/ by the lookup rule (models/options.py for the models), in step
with the builder, errors as config errors, and a new option needs no list edited."""

import dataclasses
import inspect
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from giantpipe.cli.checks import as_config_error, to_experiment
from giantpipe.cli.registration import register_configs
from giantpipe.cli.schemas import option_schemas, schema_modules
from giantpipe.config import ConfigError
from giantpipe.runner.registry import locate
from models.options import (
    AmoebaNetModelConfig,
    MlpModelConfig,
    TransformerLMModelConfig,
    TransformerTModelConfig,
)

CONF = Path(__file__).resolve().parents[3] / "conf"
OPTIONS = sorted(
    p.relative_to(CONF).as_posix() for g in ("model", "data") for p in (CONF / g).glob("*.yaml")
)


def composed(conf: Path, *overrides: str):
    register_configs(conf)
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return to_experiment(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_names_its_builder_and_a_schema_the_lookup_rule_finds(option: str):
    path = CONF / option
    target = OmegaConf.load(path)["_target_"]
    (schema,) = option_schemas(path).values()
    assert schema.__module__ in schema_modules(target)  # an options module or the builder's own
    if option.startswith("model/"):
        assert schema.__module__ == "models.options"  # torch-free
    if option.startswith("data/"):
        assert schema.__module__ == "giantpipe.data.options"  # torch-free
    assert schema._target_ == target


@pytest.mark.parametrize("option", OPTIONS)
def test_the_schema_follows_its_builder(option: str):
    """Every field is a builder argument, every required argument a field, and where both give a
    default it is the same: nothing the builder says is said differently by its schema."""
    (schema,) = option_schemas(CONF / option).values()
    params = inspect.signature(locate(schema._target_, "_target_")).parameters
    fields = {f.name: f for f in dataclasses.fields(schema) if f.name != "_target_"}
    assert set(fields) <= set(params)
    assert {n for n, p in params.items() if p.default is p.empty} <= set(fields)
    for name, field in fields.items():
        builder = params[name].default
        if builder is params[name].empty:
            continue
        if field.default_factory is not dataclasses.MISSING:
            # A mapping of further keys: the schema's empty dict is the builder's None (none given).
            assert field.default_factory() in ({}, []) and builder is None, (
                f"{schema.__name__}.{name}"
            )
        else:
            assert field.default == builder, f"{schema.__name__}.{name}"


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: MlpModelConfig(depth=0), "model.depth"),
        (lambda: MlpModelConfig(norm="group"), "model.norm"),
        (lambda: MlpModelConfig(dropout=1.0), "model.dropout"),
        (lambda: TransformerTModelConfig(max_len=1), "model.max_len"),
        (
            lambda: TransformerTModelConfig(tie_embeddings=True, share_embeddings=False),
            "model.tie_embeddings",
        ),  # fmt: skip
        (lambda: TransformerTModelConfig(ffn_init_scale="cubic"), "model.ffn_init_scale"),
        (lambda: TransformerLMModelConfig(d_model=100, num_heads=3), "model.num_heads"),
        (lambda: TransformerLMModelConfig(logit_clip_mode="soft"), "model.logit_clip_mode"),
        (lambda: AmoebaNetModelConfig(num_layers=4), "model.num_layers"),
        (lambda: AmoebaNetModelConfig(genotype="C"), "model.genotype"),
    ],
)
def test_a_model_schema_names_its_key_and_the_entry_point_shows_a_config_error(build, key):
    with pytest.raises(ValueError) as info:  # models/ import nothing of giantpipe
        build()
    assert str(info.value).startswith(f"{key}: ")
    error = as_config_error(info.value)
    assert isinstance(error, ConfigError) and error.key == key


def test_a_bad_model_value_on_the_command_line_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^model\.depth: must be >= 1, got 0$"):
        composed(CONF, "recipe=mlp_quickstart", "model.depth=0")


def test_other_value_errors_stay_what_they_are():
    error = ValueError("something: else")
    assert as_config_error(error) is error


def test_a_new_option_is_one_yaml_and_edits_no_list(tmp_path: Path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "model" / "wide_mlp.yaml").write_text(
        "defaults:\n  - MlpModelConfig\n  - _self_\n\n_target_: models.mlp.mlp\n"
        "in_features: ${data.features}\nclasses: ${data.classes}\nhidden: 128\n"
    )
    cfg = composed(conf, "recipe=mlp_quickstart", "model=wide_mlp")
    assert isinstance(cfg.model, MlpModelConfig) and cfg.model.hidden == 128
    assert cfg.model.norm == "layer"  # the schema's default, typed and checked


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("defaults:\n  - NoSuchConfig\n  - _self_\n_target_: models.mlp.mlp\n",
         "defaults name NoSuchConfig, which is neither an option of model nor a dataclass in "
         "models.mlp"),
        ("defaults:\n  - MlpModelConfig\n  - _self_\n_target_: models.amoebanet.amoebanet\n",
         "MlpModelConfig describes models.mlp.mlp, not _target_ models.amoebanet.amoebanet"),
        ("defaults:\n  - AmoebaNetModelConfig\n  - _self_\n_target_: models.amoebanet.amoebanetd\n",
         "AmoebaNetModelConfig describes models.amoebanet.amoebanet, not _target_ "
         "models.amoebanet.amoebanetd"),
        ("defaults:\n  - MlpModelConfig\n  - _self_\n_target_: models.nothing.mlp\n",
         "cannot import 'models.nothing'"),
        ("defaults:\n  - MlpModelConfig\n  - _self_\n",
         "names a schema (MlpModelConfig) but no _target_ builder"),
    ],
)  # fmt: skip
def test_an_option_naming_a_schema_not_found_or_for_another_builder_is_one_line(
    tmp_path: Path, text: str, problem: str
):
    path = tmp_path / "model" / "broken.yaml"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        register_configs(tmp_path)
    assert info.value.key == str(path) and info.value.problem.startswith(problem)
