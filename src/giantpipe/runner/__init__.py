"""The experiment runner: build parts from config, train, evaluate, checkpoint, summarize.

Nothing here imports Hydra or OmegaConf: it receives the dataclasses of ``giantpipe.config``.

Example::

    from giantpipe.runner import train
    summary = train(cfg, run_dir=Path("outputs/run"), config_yaml="...")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.runner.loop import train as train_local

__all__ = ["train"]


def train(cfg: ExperimentConfig, run_dir: Path, config_yaml: str) -> dict[str, Any]:
    """Train with ``pipeline.executor``: the local loop, or one torchrun process per stage."""
    if cfg.pipeline.executor == "distributed":
        from giantpipe.runner.distributed import train_distributed

        return train_distributed(cfg, run_dir, config_yaml)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ConfigError(
            "pipeline.executor",
            f"local runs in one process, but torchrun started {world}; set "
            "pipeline.executor=distributed",
        )
    return train_local(cfg, run_dir, config_yaml)
