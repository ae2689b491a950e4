"""The experiment runner: build parts from config, train, evaluate, checkpoint, summarize.

One runner for both executors: the local executor is a world of one process
(:class:`~giantpipe.runner.world.World`), ``pipeline.executor=distributed`` the processes
torchrun started (:class:`~giantpipe.runner.world.TorchrunWorld`); the same build, loop,
evaluation and checkpoint format serve both. Nothing here imports Hydra or OmegaConf: it
receives the dataclasses of ``giantpipe.config``; only ``giantpipe.cli`` imports the runner.

    build.py      every part from the config (data, model, plan, balance, pipe, optimizer)
    pipeline.py   PipelineConfig -> devices, balance, the pipe
    loop.py       the training loop and train()
    step.py       one optimizer step's engine steps (accumulation, replica slices, clipping)
    evaluate.py   evaluation, and the data's whole-model figures (BLEU)
    checkpoint.py the one checkpoint format; resume; starting from weights
    record.py     the run directory and the run's record (metrics, summary)
    world.py      who runs: one process or torchrun's

Example::

    from giantpipe.runner import train
    summary = train(cfg, run_dir=Path("outputs/run"), config_yaml="...")
"""

from __future__ import annotations

from giantpipe.runner.loop import train

__all__ = ["train"]
