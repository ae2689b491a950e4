"""The experiment runner: build parts from config, train, evaluate, checkpoint, summarize.

Nothing here imports Hydra or OmegaConf: it receives the dataclasses of ``giantpipe.config``.

Example::

    from giantpipe.runner import train
    summary = train(cfg, run_dir=Path("outputs/run"), config_yaml="...")
"""

from giantpipe.runner.loop import train

__all__ = ["train"]
