"""Experiment configuration: the core groups' schemas, validated in ``__post_init__`` (no torch).

Its modules: :mod:`.checks` (:class:`ConfigError`, the check helpers), :mod:`.pipeline`,
:mod:`.optim`, :mod:`.trainer`, :mod:`.logger`, :mod:`.sweep` (one group each) and
:mod:`.experiment` (the whole experiment, the fixed groups, renamed keys). The ``model`` and
``data`` groups' schemas live in torch-free ``options`` modules beside their builders
(:mod:`giantpipe.cli.schemas`). Only ``giantpipe.cli`` sees Hydra: below it, plain dataclasses.

Example::

    from giantpipe.config import ConfigError, TrainerConfig
    try:
        TrainerConfig(max_steps=0)
    except ConfigError as err:
        print(err)                                    # trainer.max_steps: must be >= 1, got 0
"""

from giantpipe.config.checks import (
    ConfigError,
    check,
    check_choice,
    check_fields_finite,
    check_finite,
    check_fits_memory,
    check_fp32,
    check_min,
    check_optional_path,
    host_memory_bytes,
    human_bytes,
)
from giantpipe.config.experiment import RENAMED_KEYS, SCHEMAS, ExperimentConfig
from giantpipe.config.logger import LoggerConfig
from giantpipe.config.optim import LRScheduleConfig, OptimConfig
from giantpipe.config.pipeline import MAX_TIMEOUT_S, PipelineConfig
from giantpipe.config.sweep import SweepConfig
from giantpipe.config.trainer import RESUME_AUTO, RESUME_CHECKED, TrainerConfig

__all__ = [
    "MAX_TIMEOUT_S",
    "RENAMED_KEYS",
    "RESUME_AUTO",
    "RESUME_CHECKED",
    "SCHEMAS",
    "ConfigError",
    "ExperimentConfig",
    "LRScheduleConfig",
    "LoggerConfig",
    "OptimConfig",
    "PipelineConfig",
    "SweepConfig",
    "TrainerConfig",
    "check",
    "check_choice",
    "check_fields_finite",
    "check_finite",
    "check_fits_memory",
    "check_fp32",
    "check_min",
    "check_optional_path",
    "host_memory_bytes",
    "human_bytes",
]
