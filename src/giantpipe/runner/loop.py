"""The training loop: optimizer steps over the engine, evaluation, checkpoints, metrics.

Example::

    summary = train(cfg, run_dir=Path("outputs/run"), config_yaml=resolved_yaml)
    summary["eval/loss"], summary["train/samples_per_s"]
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from giantpipe.config import ExperimentConfig
from giantpipe.data.bundle import Batch
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.record import StepRecord
from giantpipe.runner.build import Experiment, build_experiment
from giantpipe.runner.checkpoint import atomic_save
from giantpipe.runner.evaluate import evaluate
from giantpipe.runner.forecast import Forecast
from giantpipe.runner.init_weights import load_initial_weights
from giantpipe.runner.run_dir import LAST, check_writable, resume_checkpoint
from giantpipe.runner.run_record import after_step, base_summary, open_record, run_to_summary
from giantpipe.runner.seeding import seed_everything
from giantpipe.runner.state import Progress, capture, restore_checkpoint
from giantpipe.runner.step import accumulate_gradients
from giantpipe.runner.update import apply_update

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the bad state is not saved."""


class TrainingLoop:
    """Runs optimizer steps from ``progress`` to ``parts.total_steps``."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        parts: Experiment,
        run_dir: Path,
        metrics: MetricsLogger,
        progress: Progress,
        last_good: tuple[Path, int] | None,
    ) -> None:
        self.cfg, self.parts, self.run_dir, self.metrics = cfg, parts, run_dir, metrics
        self.progress = progress
        self.last_good = last_good
        self.last_eval: dict[str, float] = {}
        self.eval_notes: dict[str, str] = {}
        """Text figures of the latest evaluation (e.g. the BLEU signature), for the summary."""
        self.last_line: dict[str, Any] | None = None
        """The latest metrics line written; its loss is the run's final train loss."""
        self.forecast = Forecast() if cfg.trainer.predict else None
        """trainer.predict: the simulator's forecast after the first step, and the measurements."""

    # -- one step ---------------------------------------------------------------------------

    def _fail(self, what: str, value: float) -> NonFiniteLossError:
        kept = (
            f"last good checkpoint: {self.last_good[0]} (step {self.last_good[1]})"
            if self.last_good
            else "no checkpoint was written"
        )
        step = self.progress.step + 1
        return NonFiniteLossError(
            f"step {step}: {what} is {value}; stopped without saving ({kept})"
        )

    def optimizer_step(self, stream: Iterator[Batch]) -> StepRecord:
        """Accumulate gradients over trainer.accumulate batches, clip, update, advance."""
        parts, trainer = self.parts, self.cfg.trainer
        start = time.perf_counter()
        batches = [next(stream) for _ in range(trainer.accumulate)]
        parts.optimizer.zero_grad(set_to_none=True)
        loss, stats = accumulate_gradients(
            parts.pipe,
            batches,
            parts.loss_fn,
            parts.bundle.loss_normalizer,
            self.cfg.pipeline.precision,
            parts.devices,
        )
        if not math.isfinite(loss):
            raise self._fail("the loss", loss)
        grad_norm = None
        if trainer.grad_clip is not None:
            # One global norm over every stage's parameters, wherever they live.
            norm = torch.nn.utils.clip_grad_norm_(parts.pipe.parameters(), trainer.grad_clip)
            grad_norm = float(norm)
            if not math.isfinite(grad_norm):
                raise self._fail("the gradient norm", grad_norm)
        record = apply_update(parts, self.progress, batches, loss, stats, grad_norm, start)
        if self.forecast is not None:  # after the record: its step time leaves the profile out
            more = self.progress.step < parts.total_steps
            precision = self.cfg.pipeline.precision
            self.forecast.after_step(parts, precision, batches[0], stats, self.progress.step, more)
        return record

    # -- evaluation and checkpoints ---------------------------------------------------------

    def model_figures(self) -> dict[str, float]:
        """The bundle's own evaluation of the model (e.g. BLEU); text figures become notes."""
        hook = self.parts.bundle.evaluate_model
        if hook is None:
            return {}
        figures = hook(self.parts.model)
        notes = {k: v for k, v in figures.items() if isinstance(v, str)}
        for key, note in notes.items():
            log.info("step %d eval %s: %s", self.progress.step, key, note)
        self.eval_notes.update(notes)
        return {k: float(v) for k, v in figures.items() if not isinstance(v, str)}

    def evaluate(self) -> None:
        parts = self.parts

        def run() -> dict[str, float]:
            figures = evaluate(
                parts.pipe,
                parts.bundle,
                self.cfg.trainer.eval_batches,
                self.cfg.pipeline.precision,
                parts.devices,
            )
            return {**figures, **self.model_figures()}

        if parts.ema is not None:
            with parts.ema.swapped():
                self.last_eval = run()
        else:
            self.last_eval = run()
        self.metrics.evaluation(self.progress.step, self.last_eval)

    def save(self, name: str) -> None:
        path = self.run_dir / name
        atomic_save(capture(self.parts, self.progress), path)
        if name == LAST:
            self.last_good = (path, self.progress.step)

    def after_step(self) -> None:
        after_step(self, LAST, lambda step: f"step_{step}.pt")

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        stream = self.parts.bundle.train_batches(self.cfg.trainer.seed, self.progress.position)
        while self.progress.step < self.parts.total_steps:
            record = self.optimizer_step(stream)
            self.last_line = self.metrics.train_step(record) or self.last_line
            self.after_step()
        self.last_line = self.metrics.flush() or self.last_line
        if self.forecast is not None:
            self.forecast.report(self.run_dir, self.parts.pipe)
        self.evaluate()
        if self.cfg.trainer.save_last:
            self.save(LAST)


def summarize(cfg: ExperimentConfig, loop: TrainingLoop, wall_time_s: float) -> dict[str, Any]:
    """The run's figures for summary.json, the table and the sweep objective."""
    parts = loop.parts
    pipeline = {"pipeline/devices": list(parts.devices), "pipeline/balance": list(parts.balance)}
    evaluation = {**loop.last_eval, **loop.eval_notes}
    summary = base_summary(
        cfg,
        loop.progress.step,
        wall_time_s,
        loop.last_line,
        evaluation,
        loop.metrics.run_figures(),
        pipeline,
    )
    if loop.forecast is not None:
        summary.update(loop.forecast.figures())
    if parts.plan_choice is not None:
        summary["pipeline/plan_choice"] = parts.plan_choice
    return summary


def train(cfg: ExperimentConfig, run_dir: Path, config_yaml: str) -> dict[str, Any]:
    """Check, build, (resume,) train, evaluate, and write the summary; return it.

    Nothing in ``run_dir`` is written until the config, the data, the model, the balance and any
    checkpoint to resume from have all been checked.
    """
    start = time.perf_counter()
    resume_from = resume_checkpoint(cfg.trainer.resume, run_dir)
    check_writable(run_dir)
    seed_everything(cfg.trainer.seed)
    parts = build_experiment(cfg, run_dir)
    cfg = replace(cfg, pipeline=parts.pipeline)  # as run: the planner's knobs under plan=auto
    progress, last_good = Progress(), None
    if resume_from is not None:
        progress = restore_checkpoint(parts, resume_from)
        last_good = (resume_from, progress.step)
    elif cfg.trainer.init_from is not None:  # fine-tune: weights only, a fresh run otherwise
        load_initial_weights(parts, Path(cfg.trainer.init_from).expanduser())
    # -- checked: from here on the run writes into run_dir -----------------------------------
    resumed = resume_from is not None
    metrics = open_record(
        cfg,
        run_dir,
        config_yaml,
        progress.step,
        resumed,
        parts.total_steps,
        parts.devices,
        parts.balance,
        log,
    )
    loop = TrainingLoop(cfg, parts, run_dir, metrics, progress, last_good)
    return run_to_summary(
        cfg.name,
        run_dir,
        metrics,
        loop.run,
        lambda: summarize(cfg, loop, time.perf_counter() - start),
        lambda: loop.progress.step,
    )
