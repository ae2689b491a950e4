"""Hydra's ConfigStore: the experiment's schema, each option's own, and the run-id resolver.

:func:`register_configs` runs before ``@hydra.main`` (or ``compose``) and stores the real
schemas: ``base_config`` (:class:`giantpipe.config.ExperimentConfig`, the core groups) and the
dataclass of every ``model`` and ``data`` option of ``conf/``, found by the lookup rule of
:mod:`giantpipe.cli.schemas`. Composing against them reports an unknown key or a value of the
wrong type, and ``OmegaConf.to_object`` runs their ``__post_init__`` checks
(:func:`giantpipe.cli.checks.check_config`): with the project's schemas, before torch is imported.
:func:`register_run_id` gives conf/config.yaml's run directories their ``${run_id:}``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from giantpipe.cli.schemas import OPTION_GROUPS, option_schemas
from giantpipe.config import ConfigError, ExperimentConfig

STARTED = time.time()
"""When this process started: a run directory made after it, and left empty, is ours."""

CONF_DIRS: list[Path] = []
"""The conf/ directory :func:`register_configs` registered last (its recipes are read to name
one that fits)."""

OPTION_SCHEMAS: dict[str, type] = {}
"""Schema name -> class, as registered (left out of the options a mistyped ``GROUP=`` lists)."""


def register_configs(conf_dir: Path) -> None:
    """Store the schemas in Hydra's ConfigStore, before ``@hydra.main`` or ``compose``:
    ``base_config`` (the experiment) and every schema the ``model`` / ``data`` options of
    ``conf_dir`` name (:func:`giantpipe.cli.schemas.option_schemas`). Calling it again is
    harmless.

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
            for name, schema in option_schemas(path).items():
                known = OPTION_SCHEMAS.get(name)
                if known is not None and known is not schema:
                    raise ConfigError(str(path), f"a second schema named {name}")
                OPTION_SCHEMAS[name] = schema
                store.store(group=group, name=name, node=schema)


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
