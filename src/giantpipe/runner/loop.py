"""The training loop: optimizer steps over the engine, evaluation, checkpoints, metrics.

One loop for both executors. The local executor is a world of one process; under torchrun
(``pipeline.executor=distributed``) every rank runs this loop over its own stage, the steps,
the loss and the statistics are collective, and rank 0 alone writes the run directory (config,
progress bar, ``metrics.jsonl``, ``summary.json``, the log): it already holds what it logs,
because the engine gathers the loss and every stage's busy time, bubble and peak memory.

Example::

    summary = train(cfg, run_dir=Path("outputs/run"), config_yaml=resolved_yaml)
    summary["eval/loss"], summary["train/samples_per_s"]
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Collection, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from giantpipe.config import ExperimentConfig
from giantpipe.data.bundle import Batch, EvaluationError, batch_size
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.step import EngineStats, StepRecord
from giantpipe.metrics.summary import write_summary
from giantpipe.runner.build import Experiment, build_experiment
from giantpipe.runner.checkpoint import (
    BackgroundSaveError,
    CheckpointWriter,
    Progress,
    load_initial_weights,
    model_record,
    restore,
    seed_everything,
)
from giantpipe.runner.evaluate import evaluate, whole_model_figures
from giantpipe.runner.forecast import Forecast
from giantpipe.runner.record import (
    base_summary,
    check_objective,
    open_record,
    read_summary,
    run_to_summary,
)
from giantpipe.runner.rundir import (
    LAST,
    RunLock,
    check_resumed_config,
    check_writable,
    clean_interrupted_saves,
    finished_run,
    move_record_aside,
    moves_record_aside,
    resume_point,
)
from giantpipe.runner.step import accumulate_gradients
from giantpipe.runner.world import Request, StopSignals, World, open_world

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the bad state is not saved."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full or unwritable disk); the last good one stays."""


class TrainingLoop:
    """Runs optimizer steps from ``progress`` to ``parts.total_steps`` on this process."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        parts: Experiment,
        run_dir: Path,
        metrics: MetricsLogger | None,
        progress: Progress,
        last_good: tuple[Path, int] | None,
        world: World,
    ) -> None:
        self.cfg, self.parts, self.run_dir, self.metrics = cfg, parts, run_dir, metrics
        self.progress, self.last_good, self.world = progress, last_good, world
        self.last_eval: dict[str, float] = {}
        self.eval_notes: dict[str, str] = {}
        """Text figures of the latest evaluation (e.g. the BLEU signature), for the summary."""
        self.last_line: dict[str, Any] | None = None
        """The latest metrics line written; its loss is the run's final train loss."""
        self.forecast = Forecast(world) if cfg.trainer.predict else None
        """trainer.predict: the simulator's forecast after the first step, and the measurements."""
        self.stopped: str | None = None
        """Why the loop stopped early: ``preempted`` (SIGTERM), ``hangup`` (SIGHUP) or
        ``interrupted`` (Ctrl-C)."""
        self.skipped_steps = 0
        """fp16: optimizer steps the gradient scaler skipped (overflowed gradients), counted
        from this process's start (a resumed run counts from the resume)."""
        self.checkpoints = CheckpointWriter(world, cfg.trainer.async_save, self._committed)
        """Writes the checkpoints, in the step or (trainer.async_save) in the background."""
        self._about: dict[str, Any] | None = None

    # -- one step ---------------------------------------------------------------------------

    def kept(self, wait: bool = True) -> str:
        """Which checkpoint holds the run's last good state, for error lines; ``wait``: once
        the save written in the background (trainer.async_save), if any, is committed."""
        if wait:
            self._finish_quietly()
        if self.last_good is None:
            return "no checkpoint was written"
        return f"last good checkpoint: {self.last_good[0]} (step {self.last_good[1]})"

    def _fail(self, what: str, value: float, step: int | None = None) -> NonFiniteLossError:
        step = self.progress.step + 1 if step is None else step
        return NonFiniteLossError(
            f"step {step}: {what} is {value}; stopped without saving ({self.kept()})"
        )

    def _batches(self, stream: Iterator[Batch] | None) -> list[Batch | None]:
        count = self.cfg.trainer.accumulate
        return [next(stream) for _ in range(count)] if stream is not None else [None] * count

    def optimizer_step(self, stream: Iterator[Batch] | None) -> StepRecord:
        """Accumulate over trainer.accumulate batches, clip by the global norm, update, advance;
        the same loss and norm on every process.

        fp16 (``parts.grad_scaler``): the gradients are scaled; they are unscaled before the
        norm, and an overflow (an inf/NaN gradient on any rank) is no failure: the scaler
        skips the update on every rank and halves the scale."""
        parts, trainer, scaler = self.parts, self.cfg.trainer, self.parts.grad_scaler
        start = time.perf_counter()
        batches = self._batches(stream)
        parts.optimizer.zero_grad(set_to_none=True)
        loss, stats = accumulate_gradients(
            parts.pipe,
            batches,
            parts.loss_fn,
            parts.bundle.loss_normalizer,
            self.cfg.pipeline.precision,
            [parts.input_device, parts.target_device],
            scaler,
        )
        if not math.isfinite(loss):
            raise self._fail("the loss", loss)
        grad_norm = None
        if trainer.grad_clip is not None:
            if scaler is not None:
                scaler.unscale_(parts.optimizer)  # clip the true gradients, not S times them
            grad_norm = float(parts.pipe.clip_grad_norm_(trainer.grad_clip))
            if not math.isfinite(grad_norm):
                if scaler is None:
                    raise self._fail("the gradient norm", grad_norm)
                grad_norm = None  # fp16 overflowed: the scaler skips the step, no norm to log
        record = self.update(batches, loss, stats, grad_norm, start)
        if self.forecast is not None:  # after the record: its step time leaves the profile out
            more = self.progress.step < parts.total_steps
            precision = self.cfg.pipeline.precision
            self.forecast.after_step(parts, precision, batches[0], stats, self.progress.step, more)
        if self.progress.step in trainer.trace_steps:
            self._trace(self.progress.step)
        return record

    def _trace(self, step: int) -> None:
        """trainer.trace_steps: this step (its last engine step) as a Chrome / Perfetto trace,
        every rank's timings gathered on rank 0, beside the simulated step once predicted."""
        from giantpipe.perf.timeline import write_trace

        timings = self.world.collect(list(getattr(self.parts.pipe, "last_timings", [])))
        if timings is None or not self.world.writes:
            return
        forecast = self.forecast.prediction if self.forecast is not None else None
        simulation = forecast.simulation if forecast is not None else None
        path = write_trace(self.run_dir / f"trace-step{step}.json", timings, simulation)
        log.info("step %d as a trace: %s (open it in https://ui.perfetto.dev)", step, path)

    def update(
        self,
        batches: Sequence[Batch | None],
        loss: float,
        stats: list[EngineStats],
        grad_norm: float | None,
        started: float,
    ) -> StepRecord:
        """Steps the optimizer, the LR schedule and the EMA, advances the progress by one step
        and ``len(batches)`` batches, and returns the step's record."""
        parts, progress = self.parts, self.progress
        lr = float(parts.optimizer.param_groups[0]["lr"])  # the rate this step used
        skipped = self._step_optimizer()
        with warnings.catch_warnings():
            if skipped:  # the schedule follows the step count; torch's warning does not apply
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
            parts.scheduler.step()
        if parts.ema is not None:
            parts.ema.update()
        progress.step += 1
        progress.position += len(batches)
        held = [b for b in batches if b is not None]  # a rank without data counts no samples
        tokens = parts.bundle.tokens_per_batch
        return StepRecord.from_engine(
            stats,
            step=progress.step,
            loss=loss,
            lr=lr,
            step_time_s=time.perf_counter() - started,
            samples=sum(batch_size(inputs) for inputs, _ in held),
            tokens=sum(tokens(b) for b in held) if tokens is not None and held else None,
            grad_norm=grad_norm,
        )

    def _step_optimizer(self) -> bool:
        """``optimizer.step()``; fp16: through the scaler, which skips it on every rank if any
        gradient overflowed, then moves the scale (the same way on every rank). True: skipped."""
        optimizer, scaler = self.parts.optimizer, self.parts.grad_scaler
        if scaler is None:
            optimizer.step()
            return False
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        after = scaler.get_scale()
        if after < before:  # the scale only shrinks on an overflow, whose step it skipped
            self.skipped_steps += 1
            log.info(
                "step %d: fp16 gradients overflowed; the update was skipped, loss scale %g -> %g",
                self.progress.step + 1,
                before,
                after,
            )
        return after < before

    # -- evaluation and checkpoints ---------------------------------------------------------

    def _figures(self) -> dict[str, float]:
        parts, world = self.parts, self.world
        figures = evaluate(
            parts.pipe,
            parts.bundle,
            self.cfg.trainer.eval_batches,
            self.cfg.pipeline.precision,
            [parts.input_device],
            world,
        )
        whole = whole_model_figures(parts.pipe, parts.model, parts.bundle, world)
        notes = {k: v for k, v in whole.items() if isinstance(v, str)}
        for key, note in notes.items():
            log.info("step %d eval %s: %s", self.progress.step, key, note)
        self.eval_notes.update(notes)
        return {**figures, **{k: float(v) for k, v in whole.items() if not isinstance(v, str)}}

    def evaluate(self) -> None:
        try:
            if self.parts.ema is not None:
                with self.parts.ema.swapped():
                    self.last_eval = self._figures()
            else:
                self.last_eval = self._figures()
        except Exception as err:
            raise self._evaluation_failed(err) from err
        if self.metrics is not None:
            self.metrics.evaluation(self.progress.step, self.last_eval)
        loss = self.last_eval.get("loss", 0.0)
        if not math.isfinite(loss):  # the state that gave it is not saved as good
            raise self._fail("the evaluation loss", loss, self.progress.step)

    def _evaluation_failed(self, err: Exception) -> EvaluationError:
        """An evaluation that raised never loses the training done: in one process the steps
        trained are saved first (under torchrun the other ranks may be waiting inside the
        evaluation's collectives, so the last checkpoint is named instead)."""
        eval_set = getattr(err, "eval_set", None) or self.parts.bundle.eval_set
        problem = getattr(err, "problem", None) or f"{type(err).__name__}: {err}"
        if self.world.size == 1:
            self.save(LAST)
            self.finish_saves()
            kept = f"the {self.progress.step} steps trained are saved in {self.run_dir / LAST}"
        else:
            kept = self.kept()
        return EvaluationError(eval_set, f"{problem} ({kept})")

    def save(self, name: str) -> None:
        """Saves the run as ``name`` (collective): only finite weights, and a write that fails
        (a full disk) is one line naming the path, the cause and the last good checkpoint.
        trainer.async_save: returns once the state is copied; :meth:`finish_saves` waits."""
        if not self._finite():
            raise self._fail("a weight", math.nan, self.progress.step)
        directory = self.run_dir / name
        if self._about is None and self.world.rank == 0:
            self._about = model_record(self.cfg.model, self.parts.model)
        try:
            self.checkpoints.save(self.parts, self.progress, directory, self._about)
        except OSError as err:
            raise self._write_failed(err, directory, self.progress.step) from err
        except BackgroundSaveError as err:
            raise self._background_failed(err) from err.cause

    def finish_saves(self) -> None:
        """Waits for the checkpoint written in the background (trainer.async_save), if any;
        its failure is raised here, as a failed save in the step would have been."""
        try:
            self.checkpoints.wait()
        except BackgroundSaveError as err:
            raise self._background_failed(err) from err.cause

    def _committed(self, directory: Path, step: int) -> None:
        """A save is committed (in the background under trainer.async_save)."""
        if directory.name == LAST:
            self.last_good = (directory, step)

    def _write_failed(self, err: OSError, directory: Path, step: int) -> CheckpointWriteError:
        reason = err.strerror or str(err)
        return CheckpointWriteError(
            f"{err.filename or directory}: cannot save the checkpoint of step {step} "
            f"({reason}); {self.kept()}: free the space and resume with trainer.resume=true"
        )

    def _background_failed(self, err: BackgroundSaveError) -> Exception:
        if isinstance(err.cause, OSError):
            return self._write_failed(err.cause, err.directory, err.step)
        return err

    def _finite(self) -> bool:
        """Whether every weight of this process is finite, agreed by every process."""
        bad = sum(int(not torch.isfinite(p).all()) for p in self.parts.names.values())
        return self.world.sum([float(bad)])[0] == 0

    def after_step(self) -> None:
        """The cadence after each optimizer step: every ``trainer.eval_every`` steps before the
        end, evaluate, then refresh ``last/`` (with ``trainer.save_last``); every
        ``trainer.checkpoint_every`` steps, write ``step_N/`` and ``last/``."""
        trainer, step = self.cfg.trainer, self.progress.step
        if trainer.eval_every and step % trainer.eval_every == 0 and step < self.parts.total_steps:
            self.evaluate()
            if trainer.save_last:
                self.save(LAST)
        if trainer.checkpoint_every and step % trainer.checkpoint_every == 0:
            self.save(f"step_{step}")
            self.save(LAST)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except KeyboardInterrupt:
            raise  # the second Ctrl-C: stop at once, even while a save is written
        except BaseException:
            self._finish_quietly()  # the save in flight commits; the first failure is the news
            raise
        self.finish_saves()

    def _run(self) -> None:
        with StopSignals(self.cfg.trainer.save_signal, on_term=self._dying) as signals:
            try:
                self._steps(signals)
            except KeyboardInterrupt:  # the second Ctrl-C: no save, say where the run stands
                step = self.progress.step + 1
                kept = self.kept(wait=False)
                raise KeyboardInterrupt(f"stopped at once in step {step}; {kept}") from None
        if self.stopped is not None:
            return
        if self.forecast is not None and self.world.writes:
            self.forecast.report(self.run_dir, self.parts.pipe)
        self.evaluate()
        if self.cfg.trainer.save_last:
            self.save(LAST)

    def _finish_quietly(self) -> None:
        try:
            self.finish_saves()
        except Exception as err:  # noqa: BLE001 - logged: another failure is being raised
            log.error("%s", err)

    def _steps(self, signals: StopSignals) -> None:
        """Optimizer steps to the end, or to the step boundary where a signal asks to stop."""
        pipe = self.parts.pipe
        stream = (
            self.parts.bundle.train_batches(self.cfg.trainer.seed, self.progress.position)
            if pipe.needs_inputs or pipe.needs_targets
            else None
        )
        while self.progress.step < self.parts.total_steps:
            record = self.optimizer_step(stream)
            if self.metrics is not None:
                self.last_line = self.metrics.train_step(record) or self.last_line
            self.after_step()
            if self._honour(self.world.agree_stop(signals.take())):
                break
        if self.metrics is not None:
            self.last_line = self.metrics.flush() or self.last_line

    def _honour(self, request: Request) -> bool:
        """Saves on the save signal; on a stop, saves and says so. True: stop now."""
        if request.save or request.stop:
            self.save(LAST)
            if request.stop:  # about to leave: the save must be on disk first
                self.finish_saves()
            why = request.stop or f"{self.cfg.trainer.save_signal} received"
            log.info("step %d: saved %s (%s)", self.progress.step, self.run_dir / LAST, why)
        self.stopped = request.stop
        return request.stop is not None

    def _dying(self) -> None:
        """SIGTERM after a peer rank failed (torchrun stopping the survivors): say the first
        failure and die of the signal, as the launcher expects, instead of saving."""
        board = getattr(self.parts.pipe, "board", None)
        first = board.read() if board is not None else None
        if board is None or first is None:
            return
        label = board.label
        print(f"giantpipe {label}: stopped by SIGTERM; first failure: {first}", file=sys.stderr)
        if self.world.writes and self.metrics is not None:  # rank 0: the record says who failed
            failed = {"name": self.cfg.name, "status": "failed", "steps": self.progress.step}
            try:
                write_summary(self.run_dir / "summary.json", {**failed, "error": first})
            except OSError:
                pass  # dying anyway; the line above said it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def summarize(cfg: ExperimentConfig, loop: TrainingLoop, wall_time_s: float) -> dict[str, Any]:
    """The run's figures for summary.json, the table and the sweep objective."""
    parts = loop.parts
    pipeline = {
        "pipeline/executor": cfg.pipeline.executor,
        "pipeline/world_size": loop.world.size,
        "pipeline/replicas": parts.pipe.replicas,
        "pipeline/devices": list(parts.devices),
        "pipeline/balance": list(parts.balance),
    }
    figures = loop.metrics.run_figures() if loop.metrics is not None else {}
    evaluation = {**loop.last_eval, **loop.eval_notes}
    summary = base_summary(
        cfg, loop.progress.step, wall_time_s, loop.last_line, evaluation, figures, pipeline
    )
    if loop.stopped is not None:
        summary["status"] = loop.stopped  # preempted / interrupted: resumable from last/
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
    cfg = replace(cfg, pipeline=parts.pipeline)  # as run: the planner's knobs under plan=auto

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
    if world.writes:  # only once what the run resumes from has been read and accepted
        clean_interrupted_saves(run_dir)
    world.agree(lambda: check_objective(cfg, parts))
    # -- checked: from here on the run writes into run_dir -----------------------------------
    aside = resume_from is None and moves_record_aside(
        cfg.trainer.resume, run_dir, cfg.trainer.overwrite
    )
    if world.writes and aside:
        move_record_aside(run_dir)
    metrics = _open(cfg, run_dir, config_yaml, parts, progress, resume_from is not None, world)
    last_good = (resume_from, progress.step) if resume_from is not None else None
    loop = TrainingLoop(cfg, parts, run_dir, metrics, progress, last_good, world)
    summary = run_to_summary(
        cfg.name,
        run_dir,
        metrics,
        loop.run,
        lambda: summarize(cfg, loop, time.perf_counter() - start),
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
        parts.devices,
        parts.balance,
        log,
        where,
    )
