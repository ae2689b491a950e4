"""A run, start to summary: :func:`train` claims the run directory, seeds, builds, resumes or
starts (or fine-tunes), checks what is left to check, then runs the :class:`TrainingLoop` and
writes the run's record.

Nothing in the run directory is written until the config, the data, the model, the balance and
any checkpoint to resume from have all been checked (on every rank). Under torchrun every rank
calls :func:`train`; rank 0 alone writes, and every rank returns rank 0's summary.

Example::

    summary = train(cfg, run_dir=Path("outputs/run"), config_yaml=resolved_yaml)
    summary["eval/loss"], summary["train/samples_per_s"]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from giantpipe.config import ExperimentConfig
from giantpipe.config.trainer import check_trace_steps
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.runner.build import Experiment, build_experiment
from giantpipe.runner.callbacks import build_callbacks
from giantpipe.runner.dry_run import dry_run
from giantpipe.runner.keeping import Keeping
from giantpipe.runner.loop import TrainingLoop
from giantpipe.runner.monitor import check_monitor
from giantpipe.runner.record import (
    base_summary,
    check_objective,
    open_record,
    read_summary,
    run_to_summary,
)
from giantpipe.runner.run_state.init_from import load_initial_weights
from giantpipe.runner.run_state.restore import restore
from giantpipe.runner.run_state.state import Progress
from giantpipe.runner.rundir import (
    RunLock,
    check_resumed_config,
    check_writable,
    clean_interrupted_saves,
    finished_run,
    move_record_aside,
    moves_record_aside,
    resume_point,
)
from giantpipe.runner.seeding import seed_everything
from giantpipe.runner.world import World, open_world

log = logging.getLogger(__name__)


def summarize(cfg: ExperimentConfig, loop: TrainingLoop, wall_time_s: float) -> dict[str, Any]:
    """The run's figures for summary.json, the table and the sweep objective."""
    parts = loop.parts
    pipeline = {
        "pipeline/executor": cfg.pipeline.executor,
        "pipeline/world_size": loop.world.size,
        "pipeline/replicas": parts.pipe.replicas,
        "pipeline/devices": list(parts.spec.devices or ()),
        "pipeline/balance": list(parts.spec.balance),
    }
    figures = loop.metrics.run_figures() if loop.metrics is not None else {}
    evaluation = {**loop.last_eval, **loop.eval_notes}
    summary = base_summary(
        cfg,
        parts.spec,
        loop.progress.step,
        wall_time_s,
        loop.last_line,
        evaluation,
        figures,
        pipeline,
    )
    if loop.stopped is not None:
        summary["status"] = loop.stopped  # preempted / interrupted: resumable from last/
    if loop.stopped_early is not None:  # completed: what the run was asked to do is done
        summary["stopped_early"] = loop.stopped_early
    if loop.keeping is not None:
        summary.update(loop.keeping.summary())
    if loop.forecast is not None:
        summary.update(loop.forecast.figures())
    if parts.plan_choice is not None:
        summary["pipeline/plan_choice"] = parts.plan_choice
    if parts.grad_scaler is not None:  # fp16
        summary["train/loss_scale"] = parts.grad_scaler.get_scale()
        summary["train/skipped_steps"] = loop.skipped_steps
    return summary


def train(
    cfg: ExperimentConfig, run_dir: Path, config_yaml: str, derived: Collection[str] = ()
) -> dict[str, Any]:
    """Check, build, (resume,) train, evaluate, and write the summary; return it (on every
    process under torchrun: rank 0's).

    Nothing in ``run_dir`` is written until the config, the data, the model, the balance and any
    checkpoint to resume from have all been checked (on every rank). ``derived``: the keys of
    ``config_yaml`` an interpolation sets, which a resume does not compare (see
    giantpipe.runner.rundir.check_resumed_config).
    """
    if cfg.trainer.dry_run:  # the forecast only: no world, no run directory claimed
        return dry_run(cfg)
    start = time.perf_counter()
    world = open_world(cfg.pipeline)
    try:
        return _train(cfg, world.from_rank0(run_dir), config_yaml, world, start, derived)
    finally:
        world.close()


def _train(
    cfg: ExperimentConfig,
    run_dir: Path,
    config_yaml: str,
    world: World,
    start: float,
    derived: Collection[str],
) -> dict[str, Any]:
    lock = RunLock(run_dir)
    trainer = cfg.trainer

    def claim() -> None:  # one run per directory, whatever else it holds
        if world.writes:
            check_writable(run_dir)
            lock.acquire()

    world.agree(claim)
    try:
        done = world.writes and finished_run(trainer.resume, run_dir, trainer.max_steps)
        if world.from_rank0(done):  # trainer.resume=auto: a completed run, left as it is
            return world.from_rank0(_finished(run_dir) if world.writes else {})
        resume_from = world.agree(lambda: resume_point(trainer.resume, run_dir, trainer.overwrite))
        return _checked(cfg, run_dir, config_yaml, world, start, resume_from, derived)
    finally:
        if world.writes:
            lock.release()


def _checked(
    cfg: ExperimentConfig,
    run_dir: Path,
    config_yaml: str,
    world: World,
    start: float,
    resume_from: Path | None,
    derived: Collection[str] = (),
) -> dict[str, Any]:
    """Builds, restores, checks what is left to check, then runs and records the run."""
    seed_everything(cfg.trainer.seed)  # then data, then model: every rank in the same order
    parts = build_experiment(cfg, run_dir, world)
    check_trace_steps(cfg.trainer.trace_steps, parts.total_steps)  # max_epochs: known by now

    def restore_or_start() -> Progress:
        if resume_from is not None:
            return restore(parts, resume_from, world)
        if cfg.trainer.init_from is not None:  # fine-tune: weights only, a fresh run otherwise
            load_initial_weights(parts, Path(cfg.trainer.init_from).expanduser())
        return Progress()

    progress = world.agree(restore_or_start)
    if resume_from is not None and progress.step >= parts.total_steps:
        return _complete(run_dir, progress.step, parts.total_steps)
    if resume_from is not None:  # the same run goes on: its seed, model and data stay
        allowed = cfg.trainer.resume_changed
        world.agree(
            lambda: (
                check_resumed_config(resume_from, progress.step, config_yaml, allowed, derived)
                if world.writes
                else None
            )
        )
    world.agree(lambda: check_objective(cfg, parts))
    world.agree(lambda: check_monitor(cfg, parts))
    callbacks = world.agree(lambda: build_callbacks(cfg.trainer.callbacks, world))
    if world.writes:  # only once what the run resumes from has been read and accepted
        clean_interrupted_saves(run_dir)
    # rank 0's ledger: removals a kill interrupted are finished (None elsewhere)
    keeping = world.agree(
        lambda: Keeping.open(cfg, run_dir, progress.step) if world.writes else None
    )
    # -- checked: from here on the run writes into run_dir -----------------------------------
    aside = resume_from is None and moves_record_aside(
        cfg.trainer.resume, run_dir, cfg.trainer.overwrite
    )
    if world.writes and aside:
        move_record_aside(run_dir)
    metrics = _open(cfg, run_dir, config_yaml, parts, progress, resume_from is not None, world)
    last_good = (resume_from, progress.step) if resume_from is not None else None
    loop = TrainingLoop(
        cfg, parts, run_dir, metrics, progress, last_good, world, callbacks, keeping
    )
    with loop.signals:  # until the record is written: a signal at the end kills no summary
        summary = run_to_summary(
            cfg.name,
            run_dir,
            metrics,
            loop.run,
            lambda: loop.ended(summarize(cfg, loop, time.perf_counter() - start)),
            lambda: loop.progress.step,
        )
        shared: dict[str, Any] = world.from_rank0(summary)
    return shared


def _complete(run_dir: Path, step: int, total: int) -> dict[str, Any]:
    """A resume of a run that already reached trainer.max_steps: say so, change nothing."""
    log.info(
        "the run in %s is complete at step %d (trainer.max_steps gives %d steps): nothing to do; "
        "raise trainer.max_steps to continue it",
        run_dir,
        step,
        total,
    )
    print(f"{run_dir}: the run is complete at step {step}; nothing was changed", flush=True)
    return read_summary(run_dir) or {"status": "completed", "steps": step}


def _finished(run_dir: Path) -> dict[str, Any]:
    """``trainer.resume=auto`` found a completed run: say so, change nothing, return its summary
    (a sweep gets its objective back)."""
    summary = read_summary(run_dir) or {"status": "completed"}
    log.info("trainer.resume=auto: the run in %s is complete; skipped", run_dir)
    steps = summary.get("steps")
    print(f"{run_dir}: the run is complete at step {steps}; nothing was changed", flush=True)
    return summary


def _open(
    cfg: ExperimentConfig,
    run_dir: Path,
    config_yaml: str,
    parts: Experiment,
    progress: Progress,
    resumed: bool,
    world: World,
) -> MetricsLogger | None:
    """Rank 0's record of the run (None elsewhere)."""
    if not world.writes:
        return None
    where: tuple[str, tuple[Any, ...]] = ("", ())
    if world.size > 1:
        replicas = parts.pipe.replicas
        ranks = (world.size, world.size // replicas, replicas)
        where = ("distributed, %d ranks = K %d x R %d, ", ranks)
    return open_record(
        cfg,
        run_dir,
        config_yaml,
        progress.step,
        resumed,
        parts.total_steps,
        parts.spec,
        log,
        where,
        progress.window if resumed else None,
        parts.plan_choice,
    )
