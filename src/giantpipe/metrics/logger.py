"""The training loop's one door to metrics: progress bar, metrics.jsonl, W&B, run figures.

Example::

    metrics = MetricsLogger(cfg.logger, run_dir, total_steps=300, start_step=0, log_every=20,
                            name="mlp_quickstart", config=asdict(cfg))
    metrics.train_step(record)                    # every optimizer step
    metrics.evaluation(step, {"loss": 0.4, "accuracy": 0.9})
    figures = metrics.run_figures()               # for the summary
    metrics.close(summary)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from giantpipe.config import LoggerConfig
from giantpipe.metrics.record import StepRecord, Window
from giantpipe.metrics.sinks import JsonlSink, ProgressBar, WandbSink

log = logging.getLogger(__name__)


class MetricsLogger:
    """Fans records out to the configured sinks and keeps run-long figures."""

    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        log_every: int,
        name: str,
        config: dict[str, Any],
    ) -> None:
        self.log_every = log_every
        self.jsonl = JsonlSink(run_dir / "metrics.jsonl") if cfg.jsonl else None
        self.wandb = (
            WandbSink(cfg.wandb_project, cfg.wandb_mode, run_dir, name, config)
            if cfg.wandb
            else None
        )
        self.bar = ProgressBar(total_steps, start_step, cfg.progress)
        self.window = Window()
        # The run's first step pays for thread start-up and allocation; leave it out of the
        # run-long throughput unless it is the only step.
        self.run = Window()
        self.first: StepRecord | None = None
        self._last_step: int | None = None

    def _emit(self, line: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(line)
        if self.wandb is not None:
            prefix = f"{line['kind']}/"
            self.wandb.log({prefix + k: v for k, v in line.items()}, step=line["step"])

    def train_step(self, record: StepRecord) -> dict[str, Any] | None:
        """Account one optimizer step; on a logging step, write and return its line."""
        self.window.add(record)
        self._last_step = record.step
        if self.first is None:
            self.first = record
        else:
            self.run.add(record)
        self.bar.advance(1, loss=f"{record.loss:.4f}")
        if record.step % self.log_every:
            return None
        line = {"kind": "train", "step": record.step, **self.window.figures()}
        self.window = Window()
        self._emit(line)
        return line

    def flush(self) -> dict[str, Any] | None:
        """Write the partial window left at the end of training as one more line."""
        if not len(self.window) or self._last_step is None:
            return None
        line = {"kind": "train", "step": self._last_step, **self.window.figures()}
        self.window = Window()
        self._emit(line)
        return line

    def evaluation(self, step: int, figures: dict[str, float]) -> None:
        """Write an evaluation line and say it on the console / train.log."""
        self._emit({"kind": "eval", "step": step, **figures})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in figures.items())
        log.info("step %d eval: %s", step, shown)

    def run_figures(self) -> dict[str, Any]:
        """Figures over the whole run (first step excluded when there are others)."""
        if len(self.run):
            return self.run.figures()
        if self.first is None:
            return {}
        only = Window()
        only.add(self.first)
        return only.figures()

    def close(self, summary: dict[str, Any]) -> None:
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.close(summary)
