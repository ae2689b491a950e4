"""The experiment runner: build parts from config, train, evaluate, checkpoint, summarize.

One runner for both executors: the local executor is a world of one process
(:class:`~giantpipe.runner.world.World`), ``pipeline.executor=distributed`` the processes
torchrun started (:class:`~giantpipe.runner.world.TorchrunWorld`); the same build, loop,
evaluation and checkpoint format serve both. Nothing here imports Hydra or OmegaConf: it
receives the dataclasses of ``giantpipe.config``; only ``giantpipe.cli`` imports the runner.

    build.py      every part from the config (data, model, plan, pipeline spec, pipe, optimizer)
    pipeline.py   PipelineConfig -> devices, balance, the PipelineSpec (one function), the pipe
    planning.py   pipeline.plan=auto: the planner on this run's model and devices
    registry.py   objects from ``_target_`` (models and data sets as config options)
    losses.py     the loss functions and the accuracy metric the data asks for
    optim.py      the optimizer and fp16's gradient scaler it steps through
    lr_schedule.py the learning-rate schedule (step -> multiplier of optim.lr)
    ema.py        the weights' exponential moving average
    run.py        train(): a run from its run directory and checks to its summary
    loop.py       the training loop: steps, evaluation and saving cadence, stop signals
    step.py       one optimizer step's engine steps (accumulation, replica slices, clipping)
    evaluate.py   evaluation, and the data's whole-model figures (BLEU)
    forecast.py   the simulator's forecast beside the measured step, in every run
    run_state/    a run's state in its checkpoints: staged, written (in the background too),
                  restored under any layout; init_from (the format: giantpipe.checkpoint)
    seeding.py    the process's random-number generators: seeded at the start, saved, restored
    rundir.py     the run directory: where a run starts or resumes, one run at a time
    record.py     the run's record (metrics, summary)
    keeping.py    what a run keeps and when it stops early: rank 0's verdicts after evaluations
    ledger.py     RUN/checkpoints.json, and the crash-safe removal of a step_N/ giantpipe wrote
    retention.py  which step_N/ a run keeps: trainer.keep_last newest, trainer.keep_best best
    early_stop.py early stopping on the monitored figure (trainer.early_stop_patience)
    monitor.py    the monitored eval figure (trainer.monitor) and which way it improves
    callbacks.py  your own hooks named in trainer.callbacks, and their protocol
    world.py      who runs: one process or torchrun's

Example::

    from giantpipe.runner import train
    summary = train(cfg, run_dir=Path("outputs/run"), config_yaml="...")
"""

from __future__ import annotations

from giantpipe.runner.run import train

__all__ = ["train"]
