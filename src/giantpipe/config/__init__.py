"""Experiment configuration: the core groups' schemas, validated in ``__post_init__``.

One module per concept (none imports torch, so the command line checks a config before torch is
imported):

- :mod:`.checks`: :class:`ConfigError` (its message starts with the dotted key) and the check
  helpers every schema uses (``check``, ``check_min``, ``check_choice``, ..., ``human_bytes``);
- :mod:`.pipeline`: ``PipelineConfig``, the ``pipeline`` group (its shape keys' defaults and
  checks are :class:`~giantpipe.engine.spec.PipelineSpec`'s);
- :mod:`.optim`: ``OptimConfig`` and its ``LRScheduleConfig``;
- :mod:`.trainer`: ``TrainerConfig``: steps, evaluation, saving, resumption;
- :mod:`.logger`: ``LoggerConfig``: progress bar, metrics.jsonl, W&B, TensorBoard;
- :mod:`.sweep`: ``SweepConfig``: what a job returns to Hydra's sweeper;
- :mod:`.experiment`: ``ExperimentConfig`` (one field per group), ``SCHEMAS`` (the fixed groups)
  and ``RENAMED_KEYS``.

The ``model`` and ``data`` groups name a builder by ``_target_``; their schemas live in
torch-free ``options`` modules (``models/options.py``'s ``MlpModelConfig``,
``giantpipe/data/options.py``'s ``SyntheticDataConfig``, ...), found from ``conf/`` by
``giantpipe.cli.schemas`` (its lookup rule). The Hydra tree is converted to these dataclasses
once, at the entry point (``giantpipe.cli``); everything below it receives plain dataclasses and
never imports OmegaConf or Hydra. This package re-exports the names other modules import from it
(and ``MAX_TIMEOUT_S``, the engine's limit of ``pipeline.timeout``).

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
