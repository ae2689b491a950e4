"""The experiment runner: build parts from config, train, evaluate, checkpoint, summarize.

One runner for both executors (a world of one process, or torchrun's), receiving the
dataclasses of ``giantpipe.config`` and importing no Hydra
(docs/architecture.md#one-runner-for-both-executors). Its modules, one line each:
docs/architecture.md#module-map; a run's state in its checkpoints is :mod:`.run_state`.

Example::

    from giantpipe.runner import train
    summary = train(cfg, run_dir=Path("outputs/run"), config_yaml="...")
"""

from __future__ import annotations

from giantpipe.runner.run import train

__all__ = ["train"]
