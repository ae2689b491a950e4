"""The config checks: renamed and unknown keys, the data fits the model, every schema's values.

A job checks, in order: the data option holds what the model option reads (:func:`check_fits`),
then :func:`check_config`: no renamed key, no nan in the option groups, the schemas' own checks
(``OmegaConf.to_object`` runs every ``__post_init__``: the core groups', the model's and the
data's) and no unknown key. None of this imports torch where the options' schemas live in
``options`` modules (:mod:`giantpipe.cli.schemas`). Once torch is imported, :func:`late_checks`
runs the rules that need an installed package's list (``check_installed()`` of a schema).
:func:`to_experiment` is both, for scripts and tests. A model's ``ValueError("model.KEY: ...")``
becomes the :class:`giantpipe.config.ConfigError` it means (:func:`as_config_error`).

Example::

    check_fits(cfg, {"model": "amoebanet_d", "data": "tensors"}, Path("conf"))   # ConfigError
    experiment = late_checks(check_config(cfg))       # what to_experiment(cfg) does
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from giantpipe.cli.schemas import OPTION_GROUPS, option_schemas
from giantpipe.config import RENAMED_KEYS, ConfigError, ExperimentConfig, check_finite

LATE_CHECK = "check_installed"
"""The method an option's schema may define for the rules that need an installed package
(torchvision's list of classifiers, the model types transformers builds): it imports what it
needs itself and raises ``ValueError("model.KEY: ...")``; :func:`late_checks` calls it once torch
is imported, so that importing the schema stays torch-free."""


def renamed(key: str) -> str | None:
    """The new name of a renamed key or of a key under one; None for any other key.

    Example::

        renamed("optim.schedule.name")   # "optim.lr_schedule.name"
    """
    for old, new in RENAMED_KEYS.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old) :]
    return None


def to_experiment(cfg: DictConfig) -> ExperimentConfig:
    """The composed config as dataclasses, every check run: :func:`check_config`, then the
    options' late checks (:func:`late_checks`, which may import torchvision or transformers)."""
    return late_checks(check_config(cfg))


def check_config(cfg: DictConfig) -> ExperimentConfig:
    """The composed config as dataclasses (resolving interpolations, running every schema's
    ``__post_init__``: the core groups', the model's and the data's) and no key unknown to them.
    Imports no torch unless an option's schema lives beside a builder that does."""
    for old, new in RENAMED_KEYS.items():  # added with +KEY=..., which the schemas let through
        if OmegaConf.select(cfg, old, default=None) is not None:
            raise ConfigError(old, f"renamed to {new}")
    for group in OPTION_GROUPS:  # their schemas are the options' own and check no nan
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            check_finite(OmegaConf.to_container(node, resolve=False), group)
    with option_errors():
        experiment = OmegaConf.to_object(cfg)
    assert isinstance(experiment, ExperimentConfig), "conf/config.yaml must start with base_config"
    check_known_keys(cfg, experiment)
    return experiment


def late_checks(experiment: ExperimentConfig) -> ExperimentConfig:
    """Run the model's and the data's :data:`LATE_CHECK` (``check_installed()``), where their
    schema has one: the rules that need an installed package's list, run once torch is imported.

    Example::

        late_checks(experiment)   # model.name=resnet_nope: ConfigError("model.name", "not a ...")
    """
    for group in OPTION_GROUPS:
        check = getattr(getattr(experiment, group), LATE_CHECK, None)
        if callable(check):
            with option_errors():
                check()
    return experiment


@contextlib.contextmanager
def option_errors() -> Iterator[None]:
    """A ``ValueError("model.KEY: ...")`` raised inside (models/ import nothing of giantpipe)
    becomes the ConfigError it means (:func:`as_config_error`); any other error stays."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        converted = as_config_error(err)
        if converted is err:
            raise
        raise converted from err


def as_config_error(err: ValueError) -> ValueError:
    """``ValueError("model.depth: must be >= 1, got 0")`` as the ConfigError it means; any other
    ValueError unchanged.

    Example::

        as_config_error(ValueError("model.depth: must be >= 1, got 0")).key   # "model.depth"
    """
    key, sep, problem = str(err).partition(": ")
    group = key.partition(".")[0]
    if sep and group in OPTION_GROUPS and re.fullmatch(r"[\w.]+", key):
        return ConfigError(key, problem)
    return err


def near_key(key: str, schema: Any) -> str:
    """``; did you mean GROUP.FIELD?`` for an unknown ``key`` whose ``schema`` (a dataclass or
    one of its instances) has a field spelt nearly the same; "" when none is near.

    Example::

        near_key("pipeline.chunk", PipelineConfig)     # "; did you mean pipeline.chunks?"
    """
    if not dataclasses.is_dataclass(schema):
        return ""
    group, _, field = key.rpartition(".")
    names = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(field, names, n=1)
    return f"; did you mean {group + '.' if group else ''}{close[0]}?" if close else ""


def check_known_keys(cfg: DictConfig, experiment: ExperimentConfig) -> None:
    """Every key the composed config holds is a field of its schema: ``+KEY=VALUE`` may add a
    key no schema has (a typo), which Hydra lets through and the dataclasses would ignore."""
    for key in _extra_keys(cfg, experiment, ""):
        group = key.rpartition(".")[0]
        node = experiment
        for part in group.split(".") if group else []:
            node = getattr(node, part)
        hint = near_key(key, node)
        raise ConfigError(key, f"unknown key (not a field of {type(node).__name__}){hint}")


def _extra_keys(node: Any, obj: Any, prefix: str) -> list[str]:
    if not (isinstance(node, DictConfig) and dataclasses.is_dataclass(obj)):
        return []
    fields = {f.name for f in dataclasses.fields(obj)}
    found = []
    for key in map(str, node.keys()):
        name = f"{prefix}{key}"
        if key not in fields:
            found.append(name)
        else:
            found += _extra_keys(node._get_node(key), getattr(obj, key), f"{name}.")
    return found


def check_fits(cfg: DictConfig, choices: dict[str, Any], conf_dir: Path | None) -> None:
    """The data option must hold every ``data.KEY`` the model option reads
    (``num_classes: ${data.num_classes}``); else refuse, naming the data options that fit the
    model and the recipes whose model fits the data.

    Run before :func:`check_config`, which would stop at the first missing key with less to say.

    Example::

        check_fits(cfg, {"model": "amoebanet_d", "data": "tensors"}, Path("conf"))
        # ConfigError: data=tensors: model=amoebanet_d reads data.image_size, data.num_classes,
        # which it lacks; the model fits data=images_folder or ...; for this data use
        # recipe=mlp_quickstart
    """
    model, data = cfg.get("model"), cfg.get("data")
    if not (isinstance(model, DictConfig) and isinstance(data, DictConfig)):
        return
    reads = data_reads(model)
    missing = sorted(k for k in reads if k not in data)
    if not missing:
        return
    keys = ", ".join(f"data.{k}" for k in missing)
    problem = f"model={choices.get('model')} reads {keys}, which it lacks"
    if conf_dir is not None:
        options = [d for d, fields in data_fields(conf_dir).items() if reads <= fields]
        recipes = [r for r, read in recipe_reads(conf_dir).items() if read <= set(map(str, data))]
        if options:
            problem += f"; the model fits {' or '.join(f'data={d}' for d in options)}"
        if recipes:
            problem += f"; for this data use {' or '.join(f'recipe={r}' for r in recipes)}"
    raise ConfigError(f"data={choices.get('data')}", problem)


DATA_READ = re.compile(r"\$\{data\.(\w+)\}")
"""An interpolation a model option reads a data key with (``oc.select`` ones have a default)."""


def data_reads(model: Any) -> set[str]:
    """The ``data`` keys a model option's values interpolate.

    Example::

        data_reads(OmegaConf.load("conf/model/mlp.yaml"))    # {"features", "classes"}
    """
    if isinstance(model, DictConfig):
        model = OmegaConf.to_container(model, resolve=False)
    assert isinstance(model, dict), "a model option is a mapping"
    values = [v for v in model.values() if isinstance(v, str)]
    return {key for value in values for key in DATA_READ.findall(value)}


@functools.cache  # conf/ does not change while a command runs; the recipe matrix test asks often
def recipe_reads(conf_dir: Path) -> dict[str, set[str]]:
    """Recipe -> the data keys its model option reads (from conf/ alone, nothing composed)."""
    reads = {}
    for path in sorted(Path(conf_dir, "recipe").glob("*.yaml")):
        model = recipe_choices(path).get("model")
        if model is not None:
            option = Path(conf_dir, "model", f"{model}.yaml")
            reads[path.stem] = data_reads(yaml.safe_load(option.read_text()))
    return reads


@functools.cache
def data_fields(conf_dir: Path) -> dict[str, set[str]]:
    """Data option -> the keys it holds (its schema's fields)."""
    fields = {}
    for path in sorted(Path(conf_dir, "data").glob("*.yaml")):
        schemas = option_schemas(path).values()
        fields[path.stem] = {f.name for schema in schemas for f in dataclasses.fields(schema)}
    return fields


def recipe_choices(path: Path) -> dict[str, str]:
    """The options a recipe file picks (``override /model: mlp`` -> ``{"model": "mlp"}``)."""
    entries = yaml.safe_load(path.read_text()).get("defaults", [])
    picks = {}
    for entry in entries:
        if isinstance(entry, dict):
            for key, value in entry.items():
                picks[str(key).removeprefix("override ").lstrip("/")] = str(value)
    return picks
