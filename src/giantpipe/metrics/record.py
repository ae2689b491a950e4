"""One optimizer step's figures, the window that averages them, and the training loop's one door
to the sinks (progress bar, metrics.jsonl, W&B, run figures).

Example::

    window = Window()
    window.add(StepRecord(step=1, loss=2.1, lr=1e-3, step_time_s=0.02, samples=64, ...))
    window.figures()   # {"loss": 2.1, "samples_per_s": 3200.0, "bubble": ..., ...}

    metrics = MetricsLogger(cfg.logger, run_dir, total_steps=300, start_step=0, log_every=20,
                            name="mlp_quickstart", config=asdict(cfg))
    metrics.train_step(record)                    # every optimizer step
    metrics.evaluation(step, {"loss": 0.4, "accuracy": 0.9})
    figures = metrics.run_figures()               # for the summary
    metrics.close(summary)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from giantpipe.config import LoggerConfig
from giantpipe.metrics.sinks import JsonlSink, ProgressBar, WandbSink


class EngineStats(Protocol):
    """What the engine reports after a step (``pipe.last_stats``); duck-typed, no engine import."""

    wall_time_s: float
    busy_time_s: list[float]
    bubble: float
    expected_bubble: float
    peak_memory_bytes: list[int]
    memory_kind: str
    clock: str


@dataclass
class StepRecord:
    """Figures of one optimizer step (several engine steps when accumulating gradients)."""

    step: int
    loss: float
    lr: float
    step_time_s: float
    """Wall time of the whole optimizer step: engine steps, clipping, update."""
    samples: int
    tokens: int | None
    bubble: float
    """Measured idle fraction of the stages, averaged over the engine steps."""
    expected_bubble: float
    """(K - 1) / (M + K - 1)."""
    busy_time_s: list[float]
    """Per stage: seconds spent computing, summed over the engine steps."""
    peak_memory_bytes: list[int]
    """Per stage: the highest peak of the engine steps."""
    memory_kind: str
    grad_norm: float | None = None
    clock: str = "perf_counter"
    """What timed the stages: ``perf_counter`` (CPU) or ``cuda_events`` (the kernels' time)."""

    @classmethod
    def from_engine(cls, stats: list[EngineStats], **figures: Any) -> StepRecord:
        """Merge the engine's stats of the step's engine steps into one record.

        Example::

            StepRecord.from_engine([pipe.last_stats], step=3, loss=0.7, lr=1e-3,
                                   step_time_s=0.05, samples=64, tokens=None)
        """
        stages = len(stats[0].busy_time_s)
        return cls(
            bubble=sum(s.bubble for s in stats) / len(stats),
            expected_bubble=stats[0].expected_bubble,
            busy_time_s=[sum(s.busy_time_s[i] for s in stats) for i in range(stages)],
            peak_memory_bytes=[max(s.peak_memory_bytes[i] for s in stats) for i in range(stages)],
            memory_kind=stats[0].memory_kind,
            clock=stats[0].clock,
            **figures,
        )


class Window:
    """Running sums over records (since the last log line, or over the whole run).

    Sums rather than a list of records, so a run-long window costs constant memory.
    """

    def __init__(self) -> None:
        self.count = 0
        self._sums: dict[str, float] = {}
        self._busy: list[float] = []
        self._peak: list[int] = []
        self._norm_count = 0
        self._last: StepRecord | None = None

    def __len__(self) -> int:
        return self.count

    def add(self, record: StepRecord) -> None:
        self.count += 1
        for key in ("loss", "step_time_s", "samples", "bubble"):
            self._sums[key] = self._sums.get(key, 0.0) + getattr(record, key)
        self._sums["tokens"] = self._sums.get("tokens", 0.0) + (record.tokens or 0)
        self._busy = [a + b for a, b in zip(self._busy, record.busy_time_s)] or list(
            record.busy_time_s
        )
        self._peak = [max(a, b) for a, b in zip(self._peak, record.peak_memory_bytes)] or list(
            record.peak_memory_bytes
        )
        if record.grad_norm is not None:
            self._norm_count += 1
            self._sums["grad_norm"] = self._sums.get("grad_norm", 0.0) + record.grad_norm
        self._last = record

    def figures(self) -> dict[str, Any]:
        """Mean loss, throughput over the window's total time, mean bubble, max memory."""
        last, n, sums = self._last, self.count, self._sums
        assert last is not None, "figures() of an empty window"
        figures: dict[str, Any] = {
            "loss": sums["loss"] / n,
            "lr": last.lr,
            "samples_per_s": sums["samples"] / sums["step_time_s"],
            "step_time_s": sums["step_time_s"] / n,
            "bubble": sums["bubble"] / n,
            "expected_bubble": last.expected_bubble,
            "busy_time_s": [b / n for b in self._busy],
            "peak_memory_bytes": list(self._peak),
            "memory_kind": last.memory_kind,
            "clock": last.clock,
        }
        if last.tokens is not None:
            figures["tokens_per_s"] = sums["tokens"] / sums["step_time_s"]
        if self._norm_count:
            figures["grad_norm"] = sums["grad_norm"] / self._norm_count
        return figures


# ---- the loop's door to the sinks ----------------------------------------------------------

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
