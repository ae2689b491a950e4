"""The whole experiment (one field per config group), the table of fixed groups and renamed keys.

The ``model`` and ``data`` groups name a builder by ``_target_``; their schemas live in
torch-free ``options`` modules (``models/options.py``'s ``MlpModelConfig``,
``giantpipe/data/options.py``'s ``SyntheticDataConfig``, ...) and are found from ``conf/`` by
``giantpipe.cli.schemas`` (its lookup rule).

Example::

    from giantpipe.config import ExperimentConfig, PipelineConfig
    from giantpipe.data.options import SyntheticDataConfig
    from models.options import MlpModelConfig

    cfg = ExperimentConfig(model=MlpModelConfig(), data=SyntheticDataConfig(),
                           pipeline=PipelineConfig(chunks=4))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from giantpipe.config.checks import check
from giantpipe.config.logger import LoggerConfig
from giantpipe.config.optim import OptimConfig
from giantpipe.config.pipeline import PipelineConfig
from giantpipe.config.sweep import SweepConfig
from giantpipe.config.trainer import TrainerConfig, monitored

RENAMED_KEYS = {
    "pipeline.checkpoint": "pipeline.recompute",
    "optim.schedule": "optim.lr_schedule",
}
"""Old key -> new key: one word, one meaning (a checkpoint is a saved run; a schedule without
``lr_`` is the pipeline's). The entry point answers an old key with the new one."""


@dataclass
class ExperimentConfig:
    """The whole experiment: one field per config group (recipes write across all of them)."""

    name: str = "run"
    """Experiment name (recipes set it); shown in the summary and in W&B."""
    model: Any = None
    """A ``_target_`` spec building a flat nn.Sequential: the option's schema (e.g.
    ``models.options.MlpModelConfig``) or a plain mapping."""
    data: Any = None
    """A ``_target_`` spec returning a giantpipe.data.bundle.DataBundle (e.g.
    ``giantpipe.data.options.SyntheticDataConfig``) or a plain mapping."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def __post_init__(self) -> None:
        for key in ("model", "data"):
            spec = getattr(self, key)
            target = (
                spec.get("_target_") if isinstance(spec, dict) else getattr(spec, "_target_", None)
            )
            check(bool(target), f"{key}._target_", f"missing: choose a {key}=OPTION")
        if self.trainer.keep_best or self.trainer.early_stop_patience is not None:
            monitored(self.trainer, self.sweep)  # an eval figure, and which way it improves


SCHEMAS: dict[str, type] = {
    "pipeline": PipelineConfig,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "sweep": SweepConfig,
}
"""Fixed-schema groups, typed through ExperimentConfig's fields."""
