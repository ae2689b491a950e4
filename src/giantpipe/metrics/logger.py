"""The loop's door to the metrics: :class:`MetricsLogger` fans each step's record out to the
progress bar (or progress lines in the log), metrics.jsonl and the trackers, keeps the run-long
figures, and draws ``curves.png`` when the run closes.

Example::

    metrics = MetricsLogger(cfg.logger, run_dir, total_steps=300, start_step=0, log_every=20,
                            name="mlp_quickstart", config=asdict(cfg))
    metrics.train_step(record)                    # every optimizer step
    metrics.evaluation(step, {"loss": 0.4, "accuracy": 0.9})
    metrics.close(summary)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from giantpipe.config import LoggerConfig
from giantpipe.metrics.curves import plot_curves
from giantpipe.metrics.jsonl import JsonlSink, read_jsonl
from giantpipe.metrics.progress import ProgressBar, ProgressLines, wants_lines
from giantpipe.metrics.step import StepRecord, Window
from giantpipe.metrics.trackers import TensorBoardSink, WandbSink

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
        clock: Callable[[], float] = time.monotonic,
        window: dict[str, Any] | None = None,
    ) -> None:
        self.log_every = log_every
        self.run_dir = run_dir
        self.jsonl = JsonlSink(run_dir / "metrics.jsonl") if cfg.jsonl else None
        self.tensorboard = (
            TensorBoardSink(run_dir / "tensorboard", start_step) if cfg.tensorboard else None
        )
        # The lines of this process, for curves.png when there is no metrics.jsonl to read.
        self.lines: list[dict[str, Any]] = []
        self.wandb = (
            WandbSink(cfg.wandb_project, cfg.wandb_mode, run_dir, name, config)
            if cfg.wandb
            else None
        )
        self.bar = ProgressBar(total_steps, start_step, cfg.progress)
        self.progress_lines = (
            ProgressLines(total_steps, start_step, cfg.progress_every_s, clock)
            if wants_lines(cfg.progress)
            else None
        )
        # A resumed run goes on with the window the stop cut (the checkpoint carries it).
        self.window = Window.from_state(window) if window else Window()
        # The run's first step pays for thread start-up and allocation; leave it out of the
        # run-long throughput unless it is the only step.
        self.run = Window()
        self.first: StepRecord | None = None
        self._last_step: int | None = None

    def _emit(self, line: dict[str, Any]) -> None:
        self.lines.append({k: v for k, v in line.items() if k in ("kind", "step", "loss")
                           or line["kind"] == "eval"})  # fmt: skip
        if self.jsonl is not None:
            self.jsonl.write(line)
        line = {k: v for k, v in line.items() if k != "partial"}  # metrics.jsonl's mark only
        prefix = f"{line['kind']}/"
        if self.wandb is not None:
            self.wandb.log({prefix + k: v for k, v in line.items()}, step=line["step"])
        if self.tensorboard is not None:
            figures = {prefix + k: v for k, v in line.items() if k not in ("kind", "step")}
            self.tensorboard.log(figures, step=line["step"])

    def train_step(self, record: StepRecord) -> dict[str, Any] | None:
        """Account one optimizer step; on a logging step, write and return its line."""
        self.window.add(record)
        self._last_step = record.step
        if self.first is None:
            self.first = record
        else:
            self.run.add(record)
        self.bar.advance(1, loss=f"{record.loss:.4f}")
        due = record.step % self.log_every == 0
        if self.progress_lines is not None:
            said = self.progress_lines.add(
                record.step, record.loss, record.samples, record.step_time_s, due
            )
            if said is not None:
                log.info("%s", said)
        if not due:
            return None
        line = {"kind": "train", "step": record.step, **self.window.figures()}
        self.window = Window()
        self._emit(line)
        return line

    def flush(self) -> dict[str, Any] | None:
        """Write the window left at the end of training (or at a stop) as one more line,
        marked ``partial``; the window stays for :meth:`window_state`: a resumed run replaces
        the line by the whole window's."""
        if not len(self.window) or self._last_step is None:
            return None
        line = {"kind": "train", "step": self._last_step, "partial": True, **self.window.figures()}
        self._emit(line)
        return line

    def window_state(self) -> dict[str, Any] | None:
        """The logging window not yet written as a whole line (None: empty), for a checkpoint."""
        return self.window.state() if len(self.window) else None

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
        """Close the sinks and draw ``curves.png`` (a failed drawing is a warning, no more)."""
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.close(summary)
        if self.tensorboard is not None:
            self.tensorboard.close()
        # metrics.jsonl holds the steps before a resume too; the lines only this process's.
        records = read_jsonl(self.jsonl.path) if self.jsonl is not None else self.lines
        try:
            drawn = plot_curves(records, self.run_dir / "curves.png")
        except Exception as err:  # noqa: BLE001 - a picture must never fail a finished run
            log.warning("curves.png not drawn: %s: %s", type(err).__name__, err)
            return
        if drawn is not None:
            log.info("loss and evaluation curves: %s", drawn)
