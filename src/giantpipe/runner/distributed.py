"""Training with ``pipeline.executor=distributed``: one torchrun process per pipeline rank.

    torchrun --nproc_per_node=2 train.py recipe=mlp_quickstart pipeline.executor=distributed

Every rank runs this loop over its own stage (see :mod:`giantpipe.runner.dist_build`); the
steps, the loss and the statistics are collective. Rank 0 (stage 0 of replica 0) alone writes
the run directory: config, progress bar, ``metrics.jsonl``, ``summary.json`` and the log; it
already holds what it logs, because every step all-gathers the loss of the last stage and each
stage's busy time, bubble and peak memory (:mod:`giantpipe.engine.dist.pipe`). Checkpoints are
directories of shards (:mod:`giantpipe.runner.dist_checkpoint`); the set-up, all ranks in step,
is :mod:`giantpipe.runner.dist_setup`.

As in the local runner: gradient accumulation, global-norm clipping (over every stage),
the LR schedule, EMA, bf16, evaluation of loss and accuracy, ``trainer.resume`` and
``trainer.init_from`` (a ``.pt`` file). Not here: the data bundle's whole-model figures such as
BLEU (logged as skipped), multirun sweeps and the planner.

Example::

    summary = train_distributed(cfg, run_dir, config_yaml)   # on every rank, under torchrun
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.data.bundle import Batch
from giantpipe.engine.dist.pipe import clip_grad_norm_, init_distributed
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.record import StepRecord
from giantpipe.runner.dist_build import DistributedExperiment, engine_steps
from giantpipe.runner.dist_checkpoint import LAST_DIR, save_run
from giantpipe.runner.dist_eval import evaluate_distributed
from giantpipe.runner.dist_setup import agree, from_rank0, setup
from giantpipe.runner.loop import NonFiniteLossError
from giantpipe.runner.run_record import after_step, base_summary, open_record, run_to_summary
from giantpipe.runner.state import Progress
from giantpipe.runner.update import apply_update

__all__ = ["DistributedLoop", "agree", "from_rank0", "summarize", "train_distributed"]

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 1800.0
"""How long the ranks wait for rank 0 during set-up (building the data, profiling a balance)."""


class DistributedLoop:
    """Optimizer steps of this rank from ``progress`` to ``parts.total_steps``."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        parts: DistributedExperiment,
        run_dir: Path,
        metrics: MetricsLogger | None,
        progress: Progress,
    ) -> None:
        self.cfg, self.parts, self.run_dir, self.metrics = cfg, parts, run_dir, metrics
        self.progress = progress
        self.last_eval: dict[str, float] = {}
        self.last_line: dict[str, Any] | None = None
        self.last_good: tuple[Path, int] | None = None
        self.noted_skip = False

    def _fail(self, what: str, value: float) -> NonFiniteLossError:
        kept = (
            f"last good checkpoint: {self.last_good[0]} (step {self.last_good[1]})"
            if self.last_good
            else "no checkpoint was written"
        )
        return NonFiniteLossError(
            f"step {self.progress.step + 1}: {what} is {value}; stopped without saving ({kept})"
        )

    def _batches(self, stream: Iterator[Batch] | None) -> list[Batch | None]:
        count = self.cfg.trainer.accumulate
        return [next(stream) for _ in range(count)] if stream is not None else [None] * count

    def optimizer_step(self, stream: Iterator[Batch] | None) -> StepRecord:
        """Accumulate, clip by the global norm, update; the same loss and norm on every rank."""
        parts, trainer = self.parts, self.cfg.trainer
        start = time.perf_counter()
        batches = self._batches(stream)
        parts.optimizer.zero_grad(set_to_none=True)
        loss, stats = engine_steps(
            parts.pipe,
            batches,
            parts.loss_fn,
            parts.bundle.loss_normalizer,
            self.cfg.pipeline.precision,
            parts.device,
        )
        if not math.isfinite(loss):
            raise self._fail("the loss", loss)
        grad_norm = None
        if trainer.grad_clip is not None:
            grad_norm = float(clip_grad_norm_(parts.pipe, trainer.grad_clip))
            if not math.isfinite(grad_norm):
                raise self._fail("the gradient norm", grad_norm)
        return apply_update(
            parts,
            self.progress,
            batches,
            loss,
            stats,  # type: ignore[arg-type]
            grad_norm,
            start,
        )

    def evaluate(self) -> None:
        parts = self.parts

        def run() -> dict[str, float]:
            return evaluate_distributed(
                parts.pipe,
                parts.bundle,
                self.cfg.trainer.eval_batches,
                self.cfg.pipeline.precision,
                parts.device,
            )

        if parts.ema is not None:
            with parts.ema.swapped():
                self.last_eval = run()
        else:
            self.last_eval = run()
        if parts.bundle.evaluate_model is not None and not self.noted_skip:
            log.info(
                "the data's whole-model evaluation (e.g. BLEU by decoding) needs the whole model "
                "in one process: skipped under pipeline.executor=distributed; consolidate a "
                "checkpoint and evaluate it with the local executor"
            )
            self.noted_skip = True
        if self.metrics is not None:
            self.metrics.evaluation(self.progress.step, self.last_eval)

    def save(self, name: str) -> None:
        directory = self.run_dir / name
        save_run(self.parts, self.progress, directory)
        if name == LAST_DIR:
            self.last_good = (directory, self.progress.step)

    def after_step(self) -> None:
        after_step(self, LAST_DIR, lambda step: f"step_{step}")

    def run(self) -> None:
        pipe = self.parts.pipe
        feeds = pipe.needs_inputs or pipe.needs_targets
        stream = (
            self.parts.bundle.train_batches(self.cfg.trainer.seed, self.progress.position)
            if feeds
            else None
        )
        while self.progress.step < self.parts.total_steps:
            record = self.optimizer_step(stream)
            if self.metrics is not None:
                self.last_line = self.metrics.train_step(record) or self.last_line
            self.after_step()
        if self.metrics is not None:
            self.last_line = self.metrics.flush() or self.last_line
        self.evaluate()
        if self.cfg.trainer.save_last:
            self.save(LAST_DIR)


def summarize(cfg: ExperimentConfig, loop: DistributedLoop, wall_time_s: float) -> dict[str, Any]:
    """The run's figures for summary.json (rank 0), as the local runner reports them."""
    parts = loop.parts
    figures = loop.metrics.run_figures() if loop.metrics is not None else {}
    pipeline = {
        "pipeline/executor": "distributed",
        "pipeline/world_size": parts.pipe.layout.world_size,
        "pipeline/replicas": parts.pipe.replicas,
        "pipeline/devices": list(parts.devices),
        "pipeline/balance": list(parts.balance),
    }
    return base_summary(
        cfg, loop.progress.step, wall_time_s, loop.last_line, loop.last_eval, figures, pipeline
    )


def train_distributed(cfg: ExperimentConfig, run_dir: Path, config_yaml: str) -> dict[str, Any]:
    """Every rank: build its stage, (resume,) train, evaluate; rank 0 writes the run directory.

    Returns the summary on every rank (rank 0's, broadcast).
    """
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ConfigError(
            "pipeline.executor",
            "distributed needs one process per stage started by torchrun: torchrun "
            "--nproc_per_node=K train.py ... pipeline.executor=distributed",
        )
    start = time.perf_counter()
    # The world group only carries set-up (rank 0 may prepare data or profile layers for
    # minutes while the others wait) and the final summary; the steps run on the pipe's own
    # groups, under pipeline.timeout. A rank that dies still wakes the others at once.
    init_distributed(timeout=max(cfg.pipeline.timeout, SETUP_TIMEOUT_S))
    try:
        return _train(cfg, from_rank0(run_dir), config_yaml, start)
    finally:
        dist.destroy_process_group()


def _train(cfg: ExperimentConfig, run_dir: Path, config_yaml: str, start: float) -> dict[str, Any]:
    rank = dist.get_rank()
    parts, progress, resume_from = setup(cfg, run_dir)
    metrics = None
    if rank == 0:
        layout = parts.pipe.layout
        ranks = (layout.world_size, layout.workers, parts.pipe.replicas)
        metrics = open_record(
            cfg,
            run_dir,
            config_yaml,
            progress.step,
            resume_from is not None,
            parts.total_steps,
            parts.devices,
            parts.balance,
            log,
            ("distributed, %d ranks = K %d x R %d, ", ranks),
        )
    if rank == 0 and getattr(cfg.trainer, "predict", False):
        log.info("trainer.predict: the simulator's forecast is logged by the local executor only")
    loop = DistributedLoop(cfg, parts, run_dir, metrics, progress)
    if resume_from is not None:
        loop.last_good = (resume_from, progress.step)
    summary = run_to_summary(
        cfg.name,
        run_dir,
        metrics,
        loop.run,
        lambda: summarize(cfg, loop, time.perf_counter() - start),
        lambda: loop.progress.step,
    )
    shared: dict[str, Any] = from_rank0(summary)
    return shared
