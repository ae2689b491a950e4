"""The training loop: optimizer steps over the engine, evaluation, checkpoints, metrics.

One loop for both executors. The local executor is a world of one process; under torchrun
(``pipeline.executor=distributed``) every rank runs this loop over its own stage, the steps,
the loss and the statistics are collective, and rank 0 alone writes the run directory (config,
progress bar, ``metrics.jsonl``, ``summary.json``, the log): it already holds what it logs,
because the engine gathers the loss and every stage's busy time, bubble and peak memory.
Hooks: retention and early stopping (:mod:`.keeping`), your callbacks (:mod:`.callbacks`).
:func:`giantpipe.runner.run.train` opens the run around it (run directory, build, resume).

Example::

    loop = TrainingLoop(cfg, parts, run_dir, metrics, Progress(), last_good=None, world=World())
    loop.run()               # to parts.total_steps, evaluating and saving on the cadence
    loop.progress.step, loop.last_eval
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from giantpipe.config import ExperimentConfig
from giantpipe.data.bundle import Batch, EvaluationError, batch_size
from giantpipe.engine.distributed.replicas import local_tensor
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.step import EngineStats, StepRecord
from giantpipe.metrics.summary import write_summary
from giantpipe.runner.build import Experiment
from giantpipe.runner.callbacks import CallbackError, Callbacks, RunInfo, step_figures
from giantpipe.runner.evaluate import evaluate, whole_model_figures
from giantpipe.runner.forecast import Forecast
from giantpipe.runner.keeping import Keeping, judges
from giantpipe.runner.retention import BEST, EVERY
from giantpipe.runner.run_state.model_record import model_record
from giantpipe.runner.run_state.state import Progress
from giantpipe.runner.run_state.writer import BackgroundSaveError, CheckpointWriter
from giantpipe.runner.rundir import LAST
from giantpipe.runner.step import accumulate_gradients
from giantpipe.runner.world import Request, StopSignals, World

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the bad state is not saved."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full or unwritable disk); the last good one stays."""


WRITE_FIXES = {
    errno.ENOSPC: "free the space",
    errno.EDQUOT: "free the space (the disk quota is used up)",
    errno.EACCES: "make {directory} writable for this user",
    errno.EPERM: "make {directory} writable for this user",
    errno.EROFS: "move the run to a writable file system (this one is mounted read-only)",
}
"""What to do about a save that failed, by its error number (the line says the cause too)."""


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
        callbacks: Callbacks | None = None,
        keeping: Keeping | None = None,
    ) -> None:
        self.cfg, self.parts, self.run_dir, self.metrics = cfg, parts, run_dir, metrics
        self.progress, self.last_good, self.world = progress, last_good, world
        self.callbacks = callbacks or Callbacks([], configured=False)
        """trainer.callbacks built on this process (giantpipe.runner.callbacks)."""
        self.keeping = keeping
        """Rank 0's ledger, retention and early stopping (None elsewhere, or unconfigured)."""
        self.stopped_early: str | None = None
        """Why early stopping ended the run (``stopped early at step N: ...``)."""
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
        self.signals = StopSignals(cfg.trainer.save_signal, on_term=self._dying)
        """SIGTERM, SIGHUP, Ctrl-C and the save signal, caught while the run runs (:meth:`run`;
        the caller may hold them longer: ``with loop.signals:`` around its record)."""
        self._about: dict[str, Any] | None = None
        self._last_at: int | None = None
        """The step ``last/`` was last saved at by this process (it is written once a step)."""
        self._numbered_at: int | None = None
        """The step ``step_N/`` was last saved at by this process."""
        self._commits: list[tuple[Path, int]] = []
        """Saves committed (in the background too) that the main thread has not handled."""

    # -- one step ---------------------------------------------------------------------------

    def kept(self, wait: bool = True) -> str:
        """Which checkpoint holds the run's last good state, for error lines; ``wait``: once
        the save written in the background (trainer.async_save), if any, is committed."""
        if wait:
            self._finish_quietly()
        if self.last_good is None:
            return "no checkpoint was written"
        return f"last good checkpoint: {self.last_good[0]} (step {self.last_good[1]})"

    def _resume_how(self) -> str:
        """The setting that resumes from the last good checkpoint."""
        if self.last_good is None:
            return "run again"
        where = self.last_good[0]
        return "resume with " + (
            "trainer.resume=true" if where.name == LAST else f"trainer.resume={where}"
        )

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
        whole = whole_model_figures(parts.pipe, parts.bundle, world)
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
            self.save_last()
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
        self.progress.window = self.metrics.window_state() if self.metrics is not None else None
        if self._about is None and self.world.rank == 0:
            self._about = model_record(self.cfg.model, self.parts.model)
        try:
            self.checkpoints.save(self.parts, self.progress, directory, self._about)
        except OSError as err:
            raise self._write_failed(err, directory, self.progress.step) from err
        except BackgroundSaveError as err:
            raise self._background_failed(err) from err.cause
        if name == LAST:
            self._last_at = self.progress.step
        else:
            self._numbered_at = self.progress.step

    def save_last(self) -> None:
        """Saves ``last/`` unless it already holds this step: a step that evaluates and
        checkpoints, a signal at a step that saved, and the end of the run write it once."""
        if self._last_at != self.progress.step:
            self.save(LAST)

    def finish_saves(self) -> None:
        """Waits for the checkpoint written in the background (trainer.async_save), if any;
        its failure is raised here, as a failed save in the step would have been."""
        try:
            self.checkpoints.wait()
        except BackgroundSaveError as err:
            raise self._background_failed(err) from err.cause

    def _committed(self, directory: Path, step: int) -> None:
        """A save is committed (in the background under trainer.async_save): the newest one
        is the last good checkpoint (``last/`` where it holds the same step as a ``step_N/``)."""
        held = self.last_good
        if held is None or step > held[1] or (step == held[1] and directory.name == LAST):
            self.last_good = (directory, step)
        self._commits.append((directory, step))

    def _saved(self) -> None:
        """In the main thread, each save committed since the last call: the retention prunes
        (rank 0), then the callbacks hear of it."""
        while self._commits:
            directory, step = self._commits.pop(0)
            if self.keeping is not None:
                self.keeping.committed(directory, step)
            if self.callbacks.built:
                self.callbacks.call("after_save", self._info(step), directory)

    def _write_failed(self, err: OSError, directory: Path, step: int) -> CheckpointWriteError:
        reason = err.strerror or str(err)
        where = err.filename or directory
        kept = self.kept()
        fix = WRITE_FIXES.get(err.errno or 0, "remove the cause")
        return CheckpointWriteError(
            f"{where}: cannot save the checkpoint of step {step} ({reason}); {kept}: "
            f"{fix.format(directory=directory.parent)} and {self._resume_how()}"
        )

    def _background_failed(self, err: BackgroundSaveError) -> Exception:
        if isinstance(err.cause, OSError):
            return self._write_failed(err.cause, err.directory, err.step)
        return err

    def _finite(self) -> bool:
        """Whether every weight of this process is finite, agreed by every process."""
        # an FSDP2 shard: this rank's part (the sum over every process covers the rest)
        bad = sum(
            int(not torch.isfinite(local_tensor(p.detach())).all())
            for p in self.parts.names.values()
        )
        return self.world.sum([float(bad)])[0] == 0

    def after_step(self) -> None:
        """The cadence after each optimizer step: every ``trainer.eval_every`` steps before the
        end, evaluate, then refresh ``last/`` (with ``trainer.save_last``); every
        ``trainer.checkpoint_every`` steps, write ``step_N/`` and ``last/`` (once a step);
        an evaluation among the ``trainer.keep_best`` best is saved as ``step_N/`` too."""
        trainer, step = self.cfg.trainer, self.progress.step
        evaluates = bool(trainer.eval_every) and step % trainer.eval_every == 0
        evaluates = evaluates and step < self.parts.total_steps
        keeps = bool(trainer.checkpoint_every) and step % trainer.checkpoint_every == 0
        best = False
        if evaluates:
            self.evaluate()
            best, self.stopped_early = self._judge()
        why = ([EVERY] if keeps else []) + ([BEST] if best else [])
        if why:
            self._save_step(why)
        if keeps or (evaluates and trainer.save_last):
            self.save_last()
        self._saved()

    def _judge(self) -> tuple[bool, str | None]:
        """After an evaluation, rank 0's verdict on every rank: whether it is saved as one of
        the ``trainer.keep_best`` best, and why the run stops early (None: it goes on); then
        the callbacks hear of it."""
        figures = {f"eval/{key}": value for key, value in self.last_eval.items()}
        verdict: tuple[bool, str | None] = (False, None)
        if self.keeping is not None:
            verdict = self.keeping.judge(self.progress.step, figures)
        if judges(self.cfg) and self.world.size > 1:
            verdict = self.world.from_rank0(verdict)
        if self.callbacks.built:
            self.callbacks.call("after_evaluation", self._info(), figures)
        return verdict

    def _save_step(self, why: list[str]) -> None:
        """Saves ``step_N/``, recorded first (rank 0's ledger) with why it is written; one
        written already at this step is only kept for ``why`` too."""
        step = self.progress.step
        if self._numbered_at == step:
            if self.keeping is not None:
                self.keeping.tagged(step, why)
            return
        if self.keeping is not None:
            self.keeping.planned(step, why)
        self.save(f"step_{step}")

    def _info(self, step: int | None = None) -> RunInfo:
        """Where the run is, for a hook (``step``: the step a save holds, if not the run's)."""
        world, total = self.world, self.parts.total_steps
        step = self.progress.step if step is None else step
        return RunInfo(self.cfg.name, self.run_dir, step, total, world.rank, world.size)

    def _check_callbacks(self) -> None:
        """At a step's end: a hook that raised on any rank stops the run on every rank."""
        failure = self.callbacks.agreed_failure(self.world)
        if failure is not None:
            raise CallbackError(
                f"{failure}; the run stopped ({self.kept()}): fix it and {self._resume_how()}"
            ) from self.callbacks.error

    def ended(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The run has ended without failing: the callbacks get rank 0's summary (a hook that
        raises fails the run, its checkpoints as they are). Returns ``summary``."""
        if not self.callbacks.configured:
            return summary
        shared = self.world.from_rank0(summary) if self.world.size > 1 else summary
        if self.callbacks.built:
            self.callbacks.call("at_end", self._info(), shared)
        self._check_callbacks()
        return summary

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Steps to the end (or to a stop), then the final evaluation and save. The run's
        signal handling (:attr:`signals`) holds throughout: a signal after the last step is
        caught too (a stop then changes nothing: the run ends anyway; a save is the final one)."""
        with self.signals:
            try:
                self._run()
            except KeyboardInterrupt:
                raise  # the second Ctrl-C: stop at once, even while a save is written
            except BaseException:
                self._finish_quietly()  # the save in flight commits; the first failure is news
                raise
            self.finish_saves()
            self._saved()

    def _run(self) -> None:
        try:
            self._steps(self.signals)
        except KeyboardInterrupt:  # the second Ctrl-C: no save, say where the run stands
            step = self.progress.step + 1
            kept = self.kept(wait=False)
            raise KeyboardInterrupt(f"stopped at once in step {step}; {kept}") from None
        if self.stopped is not None:
            return
        if self.forecast is not None and self.world.writes:
            self.forecast.report(self.run_dir, self.parts.pipe)
        if self.stopped_early is None:  # else the run stops right after an evaluation
            self.evaluate()
            best, _ = self._judge()  # the run ends anyway: no early stop to say
            if best:
                self._save_step([BEST])
        if self.cfg.trainer.save_last:
            self.save_last()

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
            if self.callbacks.built:
                self.callbacks.call("after_step", self._info(), step_figures(record))
            self.after_step()
            self._check_callbacks()
            if self._honour(self.world.agree_stop(signals.take())):
                break
            if self.stopped_early is not None:
                log.info("%s", self.stopped_early)
                break
        if self.metrics is not None:
            self.last_line = self.metrics.flush() or self.last_line

    def _honour(self, request: Request) -> bool:
        """Saves on the save signal; on a stop, saves and says so. True: stop now."""
        if request.save or request.stop:
            self.save_last()
            if request.stop:  # about to leave: the save must be on disk first
                self.finish_saves()
            self._saved()
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
