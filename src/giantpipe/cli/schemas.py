"""How an option file finds its schema: a documented lookup rule of plain imports.

An option (``conf/GROUP/NAME.yaml``) names its builder by ``_target_`` and, first in its
defaults, the dataclass that checks its values; that name is looked up in the nearest module
named ``options`` up the builder's package path, then in the builder's own module
(:func:`schema_modules`; docs/command-line.md#errors-come-first-and-fast). A rule that needs an
installed package goes in the schema's ``check_installed()``, called once torch is imported.

Example::

    # conf/model/mlp.yaml                      # models/options.py (imports no torch)
    defaults:                                  @dataclass
      - MlpModelConfig                         class MlpModelConfig:
      - _self_                                     _target_: str = "models.mlp.mlp"
    _target_: models.mlp.mlp                       in_features: int = 16 ...
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from giantpipe.config import ConfigError

OPTION_GROUPS = ("model", "data")
"""Groups whose options name a builder by ``_target_`` and may be typed by its schema."""


def schema_names(path: Path) -> tuple[str, list[str]]:
    """The builder an option file names by ``_target_`` and the schemas its defaults name (other
    defaults entries, another option of the group to extend, are left to Hydra)."""
    option = OmegaConf.load(path)
    assert isinstance(option, DictConfig), f"{path} must hold a mapping"
    target = option.get("_target_")
    names = [n for n in option.get("defaults", []) if isinstance(n, str) and n != "_self_"]
    siblings = {p.stem for p in path.parent.glob("*.yaml")}
    wanted = [n for n in names if n not in siblings]
    if wanted and (not isinstance(target, str) or "." not in target):
        raise ConfigError(str(path), f"names a schema ({wanted[0]}) but no _target_ builder")
    return str(target), wanted


def schema_modules(target: str) -> list[str]:
    """Where the schemas of the builder ``target`` are looked up, in order: each ``options``
    module up its package path, nearest first, then the builder's own module. Imports the
    builder's parent packages only; raises ImportError if the builder's module does not exist.

    Example::

        schema_modules("models.mlp.mlp")       # ["models.options", "models.mlp"]
    """
    module = target.rpartition(".")[0]
    spec = importlib.util.find_spec(module)  # imports the parent packages, not the module
    if spec is None:
        raise ImportError("no such module")
    parts = module.split(".")
    packages = parts if spec.submodule_search_locations is not None else parts[:-1]
    options = [".".join([*packages[:i], "options"]) for i in range(len(packages), 0, -1)]
    return [*options, module]


def option_schemas(path: Path) -> dict[str, type]:
    """The schemas an option file names in its defaults list, found by the lookup rule (the
    module docstring): name -> the dataclass itself.

    Example::

        option_schemas(Path("conf/model/mlp.yaml"))    # {"MlpModelConfig": MlpModelConfig}
    """
    target, wanted = schema_names(path)
    if not wanted:
        return {}
    module_name = target.rpartition(".")[0]
    try:
        modules = [m for m in schema_modules(target) if _exists(m)]
    except ImportError as err:
        raise ConfigError(str(path), f"cannot import {module_name!r} ({err})") from err
    schemas: dict[str, type] = {}
    for name in wanted:
        schema = _find(name, modules, path)
        if schema is None:
            problem = f"defaults name {name}, which is neither an option of {path.parent.name}"
            places = " or ".join([module_name, *modules[:-1]])  # the builder's module first
            raise ConfigError(str(path), f"{problem} nor a dataclass in {places}")
        builds = getattr(schema, "_target_", target)
        if builds != target:
            raise ConfigError(str(path), f"{name} describes {builds}, not _target_ {target}")
        schemas[name] = schema
    return schemas


def _exists(module: str) -> bool:
    """Whether ``module`` can be imported (finding it imports its parent packages only)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent is a module, not a package
        return False


def _find(name: str, modules: list[str], path: Path) -> type | None:
    """The dataclass ``name`` of the first of ``modules`` that defines one (importing each)."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ConfigError(str(path), f"cannot import {module_name!r} ({err})") from err
        schema = getattr(module, name, None)
        if isinstance(schema, type) and dataclasses.is_dataclass(schema):
            return schema
    return None
