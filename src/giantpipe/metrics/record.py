"""One optimizer step's figures, and a window that averages them for a log line or the summary.

Example::

    window = Window()
    window.add(StepRecord(step=1, loss=2.1, lr=1e-3, step_time_s=0.02, samples=64, ...))
    window.figures()   # {"loss": 2.1, "samples_per_s": 3200.0, "bubble": ..., ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


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
