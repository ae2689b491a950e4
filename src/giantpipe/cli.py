"""The entry point's side of Hydra: register the schemas, convert the config once, run a job,
condense errors.

``train.py`` is a thin ``@hydra.main``; this module is the only one that touches Hydra and
OmegaConf. :func:`register_configs` stores the schemas in Hydra's ConfigStore: the core groups'
(``giantpipe.config``) and, found from ``conf/``, those of the ``model`` and ``data`` options,
which live beside their builders. :func:`to_experiment` turns the composed config into
:class:`giantpipe.config.ExperimentConfig` (validating every group in ``__post_init__``); the job
runs the training and hands Hydra the sweep objective.

The command line answers before torch is imported: the builders' modules import torch, so the
ConfigStore holds each option schema's twin, read from source (:func:`option_twins`: fields,
types, defaults). A job checks, in order: the data fits the model (:func:`check_fits`), keys,
types and the core groups' values (:func:`check_config`), then, importing the builders, the
model's and data's own values (:func:`checked_options`); only then the runner and torch. Every
refusal exits 2, a run that fails 1 (:data:`USAGE_EXIT`, :data:`FAILED_EXIT`).

How an option finds its schema (adding a model or a data set edits no list): an option file
``conf/GROUP/NAME.yaml`` names its builder by ``_target_`` and, first in its defaults, a
dataclass of the builder's module::

    # conf/model/mlp.yaml                      # models/mlp.py
    defaults:                                  def mlp(in_features=16, ...) -> nn.Sequential
      - MlpModelConfig                         @dataclass
      - _self_                                 class MlpModelConfig:
    _target_: models.mlp.mlp                       _target_: str = "models.mlp.mlp"
    hidden: 64                                     in_features: int = 16 ...

Errors become ONE line on stderr that names the key or path, and exit 2 (a config error) or 1:

    $ python train.py trainer.foo=1
    error: trainer.foo: unknown key (Key 'foo' not in 'TrainerConfig')

A multirun ends with ``sweep.md`` / ``sweep.csv`` / ``sweep.png`` in its sweep directory: each
job's swept overrides against ``sweep.objective`` (:class:`SweepTable`, a Hydra callback that
conf/config.yaml names under ``hydra.callbacks``).

Set HYDRA_FULL_ERROR=1 for the full traceback. In a multirun a failing job is logged, returns
NaN (sweepers such as Optuna mark the trial failed) and the other jobs go on. A refused config
leaves the disk as it was: the run directory Hydra made for the job (and its empty log) goes.

A run stopped by a signal exits with a documented status after saving: SIGTERM (a cluster
preempting the job) 143, SIGHUP (the terminal or SSH session went away) 129, Ctrl-C 130 (a
second Ctrl-C stops at once, also 130); the remaining jobs of a multirun are not started.

Under torchrun (``pipeline.executor=distributed``) every rank composes the config, but only
rank 0 keeps Hydra's run directory and log file: the other ranks log warnings to stderr and
learn the run directory from rank 0 (see :func:`rank_overrides`).

Example (train.py)::

    @hydra.main(config_path="conf", config_name="config", version_base="1.3")
    def main(cfg: DictConfig) -> float:
        return run_job(cfg)

    if __name__ == "__main__":
        guarded(main, conf_dir=Path(__file__).parent / "conf")   # registers, then runs
"""

from __future__ import annotations
import __future__

import ast
import copy
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import logging
import math
import os
import re
import sys
import textwrap
import time
import traceback
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from giantpipe.config import RENAMED_KEYS, ConfigError, ExperimentConfig, check_finite

log = logging.getLogger("giantpipe")

FAILURES: list[tuple[int, str]] = []
"""(exit status, line) per failed job of this process; :func:`guarded` reports them and exits
with the first status: 2 for a refused config, 1 for a run that failed."""
USAGE_EXIT = 2
"""Exit status of a usage or config error (a typo, a bad value, an option that does not fit)."""
FAILED_EXIT = 1
"""Exit status of a run that started and failed."""
PREEMPTED_EXIT = 143
"""Exit status of a run SIGTERM stopped after saving (128 + 15, what shells report for it)."""
INTERRUPTED_EXIT = 130
"""Exit status of a run Ctrl-C stopped (128 + 2)."""
HANGUP_EXIT = 129
"""Exit status of a run SIGHUP stopped after saving (128 + 1)."""
STOP_EXITS = {"preempted": PREEMPTED_EXIT, "hangup": HANGUP_EXIT, "interrupted": INTERRUPTED_EXIT}
"""The summary status of a run a signal stopped -> its exit status."""
STOPPED: list[tuple[int, str]] = []
"""(exit status, line) of a run a signal stopped; :func:`guarded` exits with it."""
STARTED = time.time()
"""When this process started: a run directory made after it, and left empty, is ours."""

OPTION_GROUPS = ("model", "data")
"""Groups whose options name a builder by ``_target_`` and may be typed by its schema."""

CONF_DIRS: list[Path] = []
"""The conf/ directory :func:`register_configs` registered last (its recipes are read to name
one that fits)."""

OPTION_SCHEMAS: dict[str, type] = {}
"""Schema name -> class, as registered (left out of the options a mistyped ``GROUP=`` lists)."""


def _schema_names(path: Path) -> tuple[str, list[str]]:
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


def schema_module(target: str) -> str:
    """The module holding the schemas of the option whose builder is ``target``: the nearest module
    named ``options`` up the builder's package path (``giantpipe.data.images.bundle.image_folder``:
    ``giantpipe.data.images.options``, then ``giantpipe.data.options``), else the builder's own.

    Example::

        schema_module("giantpipe.data.synthetic.classification")    # "giantpipe.data.options"
    """
    module = target.rpartition(".")[0]
    package = module.rpartition(".")[0]
    while package:
        try:
            if importlib.util.find_spec(f"{package}.options") is not None:
                return f"{package}.options"
        except ImportError:  # a package that cannot be imported: its builder says why later
            return module
        package = package.rpartition(".")[0]
    return module


def option_schemas(path: Path) -> dict[str, type]:
    """The schemas an option file names in its defaults list: dataclasses of its builder's module
    (importing it, and so torch: the command line reads them with :func:`option_twins` first).

    Example::

        option_schemas(Path("conf/model/mlp.yaml"))    # {"MlpModelConfig": MlpModelConfig}
    """
    target, wanted = _schema_names(path)
    if not wanted:
        return {}
    module_name = schema_module(target)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(str(path), f"cannot import {module_name!r} ({err})") from err
    schemas: dict[str, type] = {}
    for name in wanted:
        schema = getattr(module, name, None)
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            problem = f"defaults name {name}, which is neither an option of {path.parent.name}"
            raise ConfigError(str(path), f"{problem} nor a dataclass in {module_name}")
        builds = getattr(schema, "_target_", target)
        if builds != target:
            raise ConfigError(str(path), f"{name} describes {builds}, not _target_ {target}")
        schemas[name] = schema
    return schemas


def option_twins(path: Path) -> dict[str, type]:
    """The schemas an option file names, read from the source of the builder's module without
    importing it: same name, fields, types and defaults, none of the checks.

    Composing against these reports an unknown key or a value of the wrong type before torch is
    imported (the builders' modules import it); :func:`checked_options` later swaps in the real
    schemas, whose ``__post_init__`` checks the values.

    Example::

        twin = option_twins(Path("conf/model/mlp.yaml"))["MlpModelConfig"]
        twin().depth      # 7, MlpModelConfig's default, torch not imported
    """
    target, wanted = _schema_names(path)
    if not wanted:
        return {}
    module_name = schema_module(target)
    try:
        spec = importlib.util.find_spec(module_name)  # imports the parent packages only
    except ImportError as err:
        raise ConfigError(str(path), f"cannot import {module_name!r} ({err})") from err
    if spec is None or spec.origin is None:
        raise ConfigError(str(path), f"cannot import {module_name!r} (no such module)")
    twins = {}
    for name in wanted:
        twin = schema_twin(Path(spec.origin), name)
        if twin is None:
            problem = f"defaults name {name}, which is neither an option of {path.parent.name}"
            raise ConfigError(str(path), f"{problem} nor a dataclass in {module_name}")
        builds = getattr(twin, "_target_", target)
        if builds != target:
            raise ConfigError(str(path), f"{name} describes {builds}, not _target_ {target}")
        twins[name] = twin
    return twins


TWIN_NAMES: dict[str, Any] = {
    "Any": Any,
    "Literal": typing.Literal,
    "Optional": typing.Optional,
    "Union": typing.Union,
}
"""Names a schema's annotations may use besides the builtins (``int | None``, ``list[str]``)."""


def schema_twin(source: Path, name: str) -> type | None:
    """The dataclass ``name`` of ``source`` rebuilt from its field declarations: annotations and
    literal defaults, no methods. Marked ``__twin_of__ = (source, name)``; None if ``source``
    defines no dataclass of that name.

    Example::

        schema_twin(Path("models/mlp.py"), "MlpModelConfig")
    """
    tree = ast.parse(source.read_text(), filename=str(source))
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    if not found or not any("dataclass" in ast.unparse(d) for d in found[0].decorator_list):
        return None
    fields: list[tuple[str, Any, Any]] = []
    for node in found[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(node.annotation):  # not a field
            continue
        where = f"{source}:{node.lineno}"
        try:
            kind = eval(ast.unparse(node.annotation), dict(TWIN_NAMES))  # noqa: S307 - our source
            default = _twin_default(node.value)
        except (ValueError, SyntaxError, NameError, TypeError) as err:
            # The command line reads schemas before importing torch: keep their fields plain.
            problem = f"{name}.{node.target.id} must have a builtin type and a literal default"
            raise ConfigError(where, f"{problem} ({err})") from err
        fields.append((node.target.id, kind, default))
    twin = dataclasses.make_dataclass(name, fields)
    twin.__twin_of__ = (source, name)  # type: ignore[attr-defined]
    twin.__twin_checks__ = twin_checks(tree, found[0], source)  # type: ignore[attr-defined]
    return twin


PURE_MODULES = ("giantpipe.config", "models.checks")
"""Modules, besides the standard library, that a schema's checks may use before torch is
imported (their check functions: ``check_min``, ``check_choice``, ...)."""


def twin_checks(tree: ast.Module, schema: ast.ClassDef, source: Path) -> Callable[[Any], None]:
    """The ``__post_init__`` of ``schema`` (a class of ``tree``, parsed from ``source``) as a
    function of a twin, compiled from its source among the names its module binds without torch
    (:func:`pure_namespace`): one copy of each rule, run before the builder's module is imported.

    A rule that needs anything else stops the checks with NameError or ImportError;
    :func:`early_checks` leaves it, and the rules after it, to the real schema. Compiled on the
    first call: a command compiles the checks of its own model and data only.

    Example::

        tree = ast.parse(Path("models/mlp.py").read_text())
        (mlp,) = [n for n in tree.body if getattr(n, "name", "") == "MlpModelConfig"]
        twin_checks(tree, mlp, Path("models/mlp.py"))(twin)   # ValueError: model.depth: ...
    """
    methods = [n for n in schema.body if isinstance(n, ast.FunctionDef) and not n.decorator_list]

    @functools.cache
    def compiled() -> dict[str, Any]:
        space = pure_namespace(tree, source)
        for method in methods:
            _define([method], source, space)
        return space

    def run(twin: Any) -> None:
        space = compiled()
        for method in methods:  # the checks may call the schema's other methods
            if method.name != "__post_init__" and method.name in space:
                setattr(twin, method.name, space[method.name].__get__(twin))
        if "__post_init__" in space:
            space["__post_init__"](twin)

    return run


def pure_namespace(tree: ast.Module, source: Path) -> dict[str, Any]:
    """The names the top level of a module (``tree``, parsed from ``source``) binds without
    importing torch: its imports from the standard library and :data:`PURE_MODULES`, its literal
    constants and its plain functions; a function that imports something, or is decorated, is a
    stub that raises ImportError (as an absent optional package would).

    Example::

        pure_namespace(ast.parse(Path("models/mlp.py").read_text()), Path("models/mlp.py"))
        # {"NORMS": ("layer", "batch", "none"), "check_min": <function>, ...}; no "torch"
    """
    space: dict[str, Any] = {"__name__": f"twin of {source}"}
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom) and _pure_import(node):
            _define([node], source, space)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            try:
                value = ast.literal_eval(node.value)
            except ValueError:  # not a literal (a tensor, a call): not for the twin
                continue
            space.update({t.id: value for t in targets if isinstance(t, ast.Name)})
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            if node.decorator_list or _imports(node):
                space[node.name] = _needs_import(node.name, source)
            else:
                _define([node], source, space)
    return space


def _define(nodes: Sequence[ast.stmt], source: Path, space: dict[str, Any]) -> None:
    """Run top-level statements of ``source`` (imports, ``def``) in ``space``; annotations stay
    strings, as under the module's own ``from __future__ import annotations``."""
    code = compile(
        ast.Module(body=list(nodes), type_ignores=[]),
        str(source),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    try:
        exec(code, space)  # noqa: S102 - the project's own source, as importing it would
    except Exception:  # noqa: BLE001 - e.g. a default naming torch: its rules wait for the module
        return


def _pure_import(node: ast.Import | ast.ImportFrom) -> bool:
    """An import of the standard library or of :data:`PURE_MODULES` (never torch)."""
    if isinstance(node, ast.ImportFrom):
        modules = [node.module or ""] if node.level == 0 else []
    else:
        modules = [alias.name for alias in node.names]
    return bool(modules) and all(
        m in PURE_MODULES or (m.split(".")[0] in sys.stdlib_module_names and m != "__future__")
        for m in modules
    )


def _imports(node: ast.AST) -> bool:
    """Whether a function's body imports anything (``import``, ``importlib``, ``__import__``)."""
    return any(
        isinstance(n, ast.Import | ast.ImportFrom)
        or (isinstance(n, ast.Name) and n.id in ("importlib", "__import__"))
        for n in ast.walk(node)
    )


def _needs_import(name: str, source: Path) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{source}: {name} is not called before its module is imported")

    return stub


FACTORIES = {"list": list, "dict": dict, "set": set, "tuple": tuple}
"""The ``field(default_factory=NAME)`` a twin can rebuild."""


def _twin_default(value: ast.expr | None) -> Any:
    """A twin field's ``dataclasses.field`` from the source of a default: none, a literal,
    ``field(default=LITERAL)``, ``field(default_factory=list)`` or ``lambda: LITERAL``."""
    if value is None:
        return dataclasses.field()
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
        given = {k.arg: k.value for k in value.keywords}
        factory = given.get("default_factory")
        if isinstance(factory, ast.Name) and factory.id in FACTORIES:
            return dataclasses.field(default_factory=FACTORIES[factory.id])
        if isinstance(factory, ast.Lambda):
            literal = ast.literal_eval(factory.body)
            return dataclasses.field(default_factory=functools.partial(copy.deepcopy, literal))
        if factory is not None:
            raise ValueError(f"default_factory={ast.unparse(factory)} is not a builtin or literal")
        value = given.get("default")
        if value is None:
            return dataclasses.field()
    literal = ast.literal_eval(value)
    if isinstance(literal, list | dict | set):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, literal))
    return dataclasses.field(default=literal)


def register_configs(conf_dir: Path) -> None:
    """Store the schemas in Hydra's ConfigStore, before ``@hydra.main`` or ``compose``:
    ``base_config`` (the experiment) and the twin (:func:`option_twins`) of every schema the
    ``model`` / ``data`` options of ``conf_dir`` name (see the module docstring). Nothing here
    imports torch. Calling it again is harmless.

    Example::

        register_configs(Path("conf"))
        with initialize_config_dir(str(Path("conf").resolve()), version_base="1.3"):
            cfg = to_experiment(compose("config", ["recipe=mlp_quickstart"]))
    """
    register_run_id()
    CONF_DIRS[:] = [Path(conf_dir)]
    store = ConfigStore.instance()
    store.store(name="base_config", node=ExperimentConfig)
    for group in OPTION_GROUPS:
        for path in sorted(Path(conf_dir, group).glob("*.yaml")):
            for name, twin in option_twins(path).items():
                known = OPTION_SCHEMAS.get(name)
                if known is not None and known.__twin_of__ != twin.__twin_of__:  # type: ignore[attr-defined]
                    raise ConfigError(str(path), f"a second schema named {name}")
                OPTION_SCHEMAS[name] = twin
                store.store(group=group, name=name, node=twin)


def register_run_id() -> None:
    """The ``${run_id:}`` resolver of conf/config.yaml's run directories: the date, then this
    process's start time to the microsecond and its PID, so two runs started in the same second
    (or microsecond) never share a directory.

    Example::

        register_run_id()
        OmegaConf.create({"dir": "outputs/${run_id:}"}).dir
        # "outputs/2026-12-03/13-25-07.123456-4242"
    """
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", lambda: RUN_ID)


RUN_ID = time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(STARTED)) + (
    f".{int(STARTED % 1 * 1e6):06d}-{os.getpid()}"
)
"""This process's run id (see :func:`register_run_id`); the same for every job of a multirun."""


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
    """The composed config as dataclasses, every check run: :func:`check_config`, then the model's
    and the data's own schemas (:func:`checked_options`, which imports their builders)."""
    return checked_options(check_config(cfg))


def check_config(cfg: DictConfig) -> ExperimentConfig:
    """The composed config as dataclasses (resolving interpolations, running the core groups'
    checks) without importing torch: ``model`` and ``data`` are still their schemas' twins."""
    for old, new in RENAMED_KEYS.items():  # added with +KEY=..., which the schemas let through
        if OmegaConf.select(cfg, old, default=None) is not None:
            raise ConfigError(old, f"renamed to {new}")
    for group in OPTION_GROUPS:  # their schemas live beside the builders and check no nan
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            check_finite(OmegaConf.to_container(node, resolve=False), group)
    experiment = OmegaConf.to_object(cfg)
    assert isinstance(experiment, ExperimentConfig), "conf/config.yaml must start with base_config"
    check_known_keys(cfg, experiment)
    early_checks(experiment)
    return experiment


def early_checks(experiment: ExperimentConfig) -> None:
    """Run the model's and the data's own checks on their twins, before torch: the rules of
    each schema's ``__post_init__`` that need nothing but plain Python (:func:`twin_checks`).
    A rule that needs its module stops the early checks of its group; :func:`checked_options`
    runs every rule again on the real schema.

    Example::

        early_checks(experiment)   # model.depth=0: ConfigError("model.depth", "must be >= 1...")
    """
    for group in OPTION_GROUPS:
        spec = getattr(experiment, group)
        checks = getattr(type(spec), "__twin_checks__", None)
        if checks is None:
            continue
        try:
            checks(spec)
        except (NameError, ImportError):  # a rule needs the builder's module: checked later
            continue
        except ConfigError:
            raise
        except ValueError as err:  # models/ raise "model.KEY: ..."
            raise as_config_error(err) from err


def checked_options(experiment: ExperimentConfig) -> ExperimentConfig:
    """``experiment`` with its model and data twins replaced by their real schemas, built from
    the same values, so their ``__post_init__`` checks run (this imports the builders' modules).

    Example::

        experiment = checked_options(check_config(cfg))   # model.depth=0: ConfigError
    """
    for group in OPTION_GROUPS:
        spec = getattr(experiment, group)
        twin_of = getattr(type(spec), "__twin_of__", None)
        if twin_of is None:
            continue
        schema = _real_schema(spec._target_, *twin_of)
        values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        try:
            setattr(experiment, group, schema(**values))
        except ConfigError:
            raise
        except ValueError as err:  # a schema beside its builder: models/ raise "model.KEY: ..."
            raise as_config_error(err) from err
    return experiment


def _real_schema(target: str, source: Path, name: str) -> type:
    """The schema ``name`` beside the builder ``target``; failing that, in the module the option
    file named it from (``source``): ``model._target_=my.builder`` may keep the option's schema."""
    error: Exception | None = None
    for module_name in (target.rpartition(".")[0], _module_of(source)):
        if module_name is None:
            continue
        try:
            schema = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as err:
            error = error or err
            continue
        assert isinstance(schema, type)
        return schema
    raise ConfigError(f"{target}", f"cannot load the schema {name} ({error})")


def _module_of(source: Path) -> str | None:
    """The importable name of the file ``source`` (``models/mlp.py``: ``models.mlp``), if any."""
    path = Path(source).resolve().with_suffix("")
    for entry in sys.path:
        root = Path(entry or ".").resolve()
        if path.is_relative_to(root):
            return ".".join(path.relative_to(root).parts)
    return None


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
    """Data option -> the keys it holds (its schema's fields), read without importing torch."""
    fields = {}
    for path in sorted(Path(conf_dir, "data").glob("*.yaml")):
        twins = option_twins(path).values()
        fields[path.stem] = {f.name for twin in twins for f in dataclasses.fields(twin)}
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


def objective(summary: dict[str, object], key: str) -> float:
    """The number a sweeper optimizes: ``summary[sweep.objective]``."""
    if key not in summary:
        raise ConfigError("sweep.objective", f"{key!r} is not in the summary: {sorted(summary)}")
    return float(summary[key])  # type: ignore[arg-type]


def torchrun_rank() -> int:
    """This process's rank under torchrun (0 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def rank_overrides(argv: list[str], rank: int) -> list[str]:
    """Hydra overrides for a torchrun rank other than 0: no log file, no run directory of its
    own (its default would be a second, time-stamped one); rank 0's is used instead.

    Example::

        rank_overrides(["train.py", "recipe=mlp_quickstart"], rank=1)
        # [..., "hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.run.dir=."]
    """
    if rank == 0:
        return argv
    extra = ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv):
        extra.append("hydra.run.dir=.")
    return [*argv, *extra]


def run_job(cfg: DictConfig) -> float:
    """Train one job; on failure record one line and return NaN instead of raising.

    The config is checked before the runner (and torch) is imported, so a typo or a bad value is
    reported at once. Raising would make Hydra print its own multi-line report and, in a
    multirun, stop the remaining jobs; :func:`guarded` reports the recorded lines and sets the
    exit code.
    """
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if STOPPED:  # a signal stopped an earlier job of this multirun: start no other
        _leave_as_found(run_dir)
        return math.nan
    try:
        check_fits(cfg, dict(hydra_cfg.runtime.choices), CONF_DIRS[-1] if CONF_DIRS else None)
        experiment = check_config(cfg)
        if multirun and experiment.pipeline.executor == "distributed":
            raise ConfigError(
                "pipeline.executor", "distributed runs one job per torchrun launch, not sweeps"
            )
        experiment = checked_options(experiment)
        from giantpipe.runner import train  # torch: only once the config holds

        overrides = " ".join(hydra_cfg.overrides.task) or "(none)"
        # The resolved config, headed by the command line that produced it.
        config_yaml = f"# overrides: {overrides}\n" + OmegaConf.to_yaml(cfg, resolve=True)
        summary = train(experiment, run_dir, config_yaml, derived_keys(cfg))
        if _stopped(summary, run_dir):
            return math.nan
        if experiment.sweep.objective not in summary:  # a distributed run's rank > 0
            return math.nan
        return objective(summary, experiment.sweep.objective)
    except KeyboardInterrupt as err:  # the second Ctrl-C
        STOPPED.append((INTERRUPTED_EXIT, f"interrupted: {err or 'stopped at once by Ctrl-C'}"))
        return math.nan
    except Exception as err:  # noqa: BLE001 - every failure becomes one reported line
        if os.environ.get("GIANTPIPE_FULL_ERROR") == "1":
            raise
        code = USAGE_EXIT if is_config_error(err) else FAILED_EXIT
        FAILURES.append((code, _failure_line(err, run_dir, hydra_cfg, multirun)))
        return math.nan


def is_config_error(err: BaseException) -> bool:
    """A refused config (exit 2), as opposed to a run that failed (exit 1)."""
    return isinstance(err, ConfigError | OmegaConfBaseException | ConfigCompositionException)


def derived_keys(cfg: DictConfig) -> list[str]:
    """The keys of the ``model`` and ``data`` groups that an interpolation sets (e.g.
    ``model.in_features: ${data.features}``): a resume compares their sources, not them.

    Example::

        derived_keys(cfg)     # ["model.classes", "model.in_features"] for recipe=mlp_quickstart
    """
    found = []
    for group in OPTION_GROUPS:
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            found += _interpolated(node, group)
    return found


def _interpolated(node: DictConfig, prefix: str) -> list[str]:
    found = []
    for key in map(str, node.keys()):
        if OmegaConf.is_interpolation(node, key):
            found.append(f"{prefix}.{key}")
        elif isinstance(child := node._get_node(key), DictConfig):
            found += _interpolated(child, f"{prefix}.{key}")
    return found


def _stopped(summary: dict[str, object], run_dir: Path) -> bool:
    """Records a run a signal stopped (after it saved), for :func:`guarded`'s exit status."""
    status = summary.get("status")
    if status not in STOP_EXITS:
        return False
    code = STOP_EXITS[str(status)]
    line = (
        f"{status} at step {summary.get('steps')}: saved {run_dir / 'last'}; continue with "
        f"trainer.resume=true hydra.run.dir={run_dir}"
    )
    STOPPED.append((code, line))
    return True


def _failure_line(err: Exception, run_dir: Path, hydra_cfg: Any, multirun: bool) -> str:
    """The one line of a failed job; a crash keeps its traceback beside the run, a refused
    config leaves the disk as it was."""
    line = one_line(err)
    if torchrun_rank() > 0:
        line = f"rank {torchrun_rank()}: {line}"
    elif is_config_error(err):
        _leave_as_found(run_dir)
    elif not isinstance(err, OSError):  # a crash, not the disk: keep the traceback, if it fits
        trace = run_dir / "error.txt"
        try:
            trace.write_text("".join(traceback.format_exception(err)))
            line = f"{line} (traceback: {trace})"
        except OSError:
            pass
    if multirun:
        line = f"job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)}): {line}"
        log.error(line)
    return line


def _leave_as_found(run_dir: Path) -> None:
    """Removes what Hydra made for a job this process refused: its empty log file and, when
    nothing else is in them, the run directory (and its date folder) made since we started."""
    log_file = run_dir / f"{HydraConfig.get().job.name}.log"
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == log_file:
            handler.close()
            root.removeHandler(handler)  # a later record would make the file again
    if log_file.is_file() and log_file.stat().st_size == 0:
        log_file.unlink()
    folder = run_dir
    while folder != folder.parent and folder != Path.cwd():
        try:
            if folder.stat().st_mtime < STARTED - 1 or any(folder.iterdir()):
                return
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def check_known_keys(cfg: DictConfig, experiment: ExperimentConfig) -> None:
    """Every key the composed config holds is a field of its schema: ``+KEY=VALUE`` may add a
    key no schema has (a typo), which Hydra lets through and the dataclasses would ignore."""
    for key in _extra_keys(cfg, experiment, ""):
        group, _, field = key.rpartition(".")
        node = experiment
        for part in group.split(".") if group else []:
            node = getattr(node, part)
        names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        close = difflib.get_close_matches(field, names, n=1)
        hint = f"; did you mean {group}.{close[0]}?" if close else ""
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


def _first_line(text: str) -> str:
    return next((part.strip() for part in text.splitlines() if part.strip()), text.strip())


def one_line(err: BaseException) -> str:
    """A one-line description of ``err`` naming the config key or the path involved, and the
    reason (never only the first line of a message whose reason is on the next)."""
    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    cause = err.__cause__ if isinstance(err, ConfigCompositionException) else err
    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf_line(cause)
    if isinstance(cause, yaml.MarkedYAMLError):
        return _yaml_line(cause)
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    io = err.__cause__
    if isinstance(err, ValueError) and isinstance(io, OSError) and io.filename:
        # logging.config could not open Hydra's log file: the run directory is not writable
        return f"hydra.run.dir: cannot write {io.filename} ({io.strerror or io})"
    if isinstance(err, ConfigCompositionException):
        return _joined(str(err))
    return f"{type(err).__name__}: {_joined(str(err))}"


def _joined(text: str) -> str:
    """A message's lines on one line (its reason is often on the second)."""
    return "; ".join(part.strip() for part in text.splitlines() if part.strip()) or text.strip()


def _omegaconf_line(cause: OmegaConfBaseException) -> str:
    key = getattr(cause, "full_key", None) or ""
    if renamed(key):
        return f"{key}: renamed to {renamed(key)}"
    problem = _first_line(str(cause))
    if "not in" in problem and key:
        return f"{key}: unknown key ({problem})"
    return f"{key}: {problem}" if key else _joined(str(cause))


def _yaml_line(err: yaml.MarkedYAMLError) -> str:
    """``conf/optim/adamw.yaml:10: while parsing a flow sequence: expected ',' or ']'``."""
    mark = err.problem_mark or err.context_mark
    where = f"{mark.name}:{mark.line + 1}" if mark is not None else "a config file"
    reason = ": ".join(part for part in (err.context, err.problem) if part)
    return f"{where}: {reason or type(err).__name__}"


def _missing_option(err: MissingConfigException) -> str:
    """``model=foo``: an option that does not exist; list the real ones (schemas left out)."""
    group, _, option = (err.missing_cfg_file or "").rpartition("/")
    if not group or err.options is None:  # not a GROUP=OPTION choice: the primary config
        return _first_line(str(err))
    shown = ", ".join(o for o in err.options if o not in OPTION_SCHEMAS)
    return f"{group}={option}: no such option" + (f" (available: {shown})" if shown else "")


class SweepTable(Callback):
    """Hydra callback: at the end of a multirun, the sweep's table and plot in its directory
    (:func:`giantpipe.metrics.write_sweep_table`), and the table on stdout.

    Example (conf/config.yaml)::

        hydra:
          callbacks:
            sweep_table:
              _target_: giantpipe.cli.SweepTable
    """

    def __init__(self) -> None:
        self.launched: dict[int, list[str]] = {}
        """Job number -> its overrides, for jobs refused before they left a directory."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        job = OmegaConf.select(config, "hydra.job.num", default=None)
        if job is not None and job_return.overrides is not None:
            self.launched[int(job)] = list(job_return.overrides)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from giantpipe.metrics import write_sweep_table

        sweep_dir = Path(str(config.hydra.sweep.dir))
        objective = str(OmegaConf.select(config, "sweep.objective", default="eval/loss"))
        try:
            written = write_sweep_table(sweep_dir, objective, self.launched)
        except Exception as err:  # noqa: BLE001 - a summary must never fail the sweep
            log.warning("sweep table not written: %s: %s", type(err).__name__, err)
            return
        if written:
            print(written[0].read_text(), flush=True)
            log.info("sweep table and plot: %s", ", ".join(str(p) for p in written))


def guarded(main: Callable[[], None], conf_dir: Path) -> None:
    """Register the schemas of ``conf_dir`` and run a ``@hydra.main`` function; report failures
    as one line each and exit non-zero (143 / 129 / 130 for a run a signal stopped)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ["GIANTPIPE_FULL_ERROR"] = "1"  # the user wants tracebacks: keep them
    else:
        os.environ["HYDRA_FULL_ERROR"] = "1"  # make Hydra raise, so the error reaches us whole
    logging.raiseExceptions = False  # a log line lost to a full disk must not end the run
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(usage(conf_dir))  # ours, not Hydra's: it composes nothing and names the recipes
        sys.exit(0)
    sys.argv = rank_overrides(sys.argv, torchrun_rank())
    try:
        register_configs(conf_dir)
        main()
    except KeyboardInterrupt:
        print("error: interrupted before training started; nothing was written", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    except Exception as err:  # noqa: BLE001 - composition and launch errors
        if os.environ.get("GIANTPIPE_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    for _, line in FAILURES:
        print(f"error: {line}", file=sys.stderr)
    if STOPPED:
        code, line = STOPPED[0]
        print(line, file=sys.stderr)
        sys.exit(code)
    if FAILURES:
        sys.exit(max(code for code, _ in FAILURES))  # a refused job (2) outranks a failed one


USAGE = """\
usage: python train.py [recipe=NAME] [GROUP=OPTION ...] [KEY=VALUE ...]
       python train.py -m KEY=A,B ...          a sweep: one job per value
       python train.py --cfg job [...]         print the composed config (every key), run nothing

Recipes (recipe=NAME; the default is {default}):
{recipes}

Groups (GROUP=OPTION: a recipe picks one option of each; choose another on the command line):
{groups}

Exit status: 0 done; 1 the run failed; 2 a usage or config error (nothing trained, nothing
written); 129, 130, 143 stopped by SIGHUP, Ctrl-C, SIGTERM (after saving).
Runs land in outputs/DATE/TIME.MICROSECONDS-PID; more in docs/command-line.md."""


def usage(conf_dir: Path) -> str:
    """``python train.py --help``: the recipes, one line each (the ``# Summary:`` line of each
    conf/recipe/NAME.yaml), and the options of each group a user chooses. Reads conf/ only.

    Example::

        print(usage(Path("conf")))
    """
    recipes = sorted(Path(conf_dir, "recipe").glob("*.yaml"))
    width = max((len(p.stem) for p in recipes), default=0) + 2
    lines = [f"  {p.stem:<{width}}{recipe_summary(p)}" for p in recipes]
    groups = sorted(p for p in Path(conf_dir).iterdir() if p.is_dir() and p.name != "recipe")
    options = [
        textwrap.fill(
            ", ".join(sorted(o.stem for o in g.glob("*.yaml"))),
            width=100,
            initial_indent=f"  {g.name:<10}",
            subsequent_indent=" " * 12,
        )
        for g in groups
    ]
    main = yaml.safe_load(Path(conf_dir, "config.yaml").read_text())
    picks = [e["recipe"] for e in main.get("defaults", []) if isinstance(e, dict) and "recipe" in e]
    return USAGE.format(
        default=picks[0] if picks else "none", recipes="\n".join(lines), groups="\n".join(options)
    )


def recipe_summary(path: Path) -> str:
    """The one line a recipe file gives after ``# Summary:`` (its description in ``--help``)."""
    for line in path.read_text().splitlines():
        if line.startswith("# Summary:"):
            return line.removeprefix("# Summary:").strip()
    return NO_SUMMARY


NO_SUMMARY = "(no '# Summary:' line in its yaml)"
"""What ``--help`` says of a recipe file without its one line (tests/integration/test_cli.py
fails on it)."""
