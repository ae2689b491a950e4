"""The step record: one optimizer step's figures (:class:`StepRecord`), the :class:`Window`
that sums them, and :func:`breakdown`, where a pipeline's time went.

The engine's step statistics are duck-typed (:class:`EngineStats`): nothing here imports the
engine.

Example::

    window = Window()
    window.add(StepRecord(step=1, loss=2.1, lr=1e-3, step_time_s=0.02, samples=64, ...))
    window.figures()   # {"loss": 2.1, "samples_per_s": 3200.0, "bubble": ..., ...}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol


class EngineStats(Protocol):
    """What the engine reports after a step (``pipe.last_stats``); duck-typed, no engine import."""

    wall_time_s: float
    span_s: float
    busy_time_s: list[float]
    recompute_time_s: list[float]
    bubble: float
    expected_bubble: float
    peak_memory_bytes: list[int]
    memory_kind: str
    clock: str


def breakdown(busy: Sequence[float], recompute: Sequence[float], span: float) -> dict[str, float]:
    """Where a pipeline's time went, as the paper's Section 3.1 reads it, over K stage
    timelines of ``span`` seconds each (sums over as many steps as you like).

    - ``recompute_share``: re-materialization's share of the K timelines,
      sum(recompute) / (K x span); the paper reports up to 23% of the step;
    - ``stage_imbalance``: the busiest stage over the mean one, minus 1 (3.2% at K=2 in the
      paper): what a better balance could win back.

    The measured ``bubble`` (1 - sum(busy) / (K x span)) and its bound (K-1)/(M+K-1) come with
    every step already (:class:`StepRecord`): the paper's bubble is below the bound because
    recomputation runs while a stage would otherwise wait.

    >>> {k: round(v, 3) for k, v in breakdown([0.6, 0.8], [0.1, 0.2], span=1.0).items()}
    {'recompute_share': 0.15, 'stage_imbalance': 0.143}
    """
    k = len(busy)
    mean = sum(busy) / k if k else 0.0
    return {
        "recompute_share": sum(recompute) / (k * span) if k and span > 0 else 0.0,
        "stage_imbalance": max(busy) / mean - 1.0 if mean > 0 else 0.0,
    }


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
    recompute_time_s: list[float]
    """Per stage: of the busy seconds, those spent re-materializing forwards."""
    span_s: float
    """Seconds from the first action to the last, summed over the engine steps."""
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
            recompute_time_s=[sum(s.recompute_time_s[i] for s in stats) for i in range(stages)],
            span_s=sum(s.span_s for s in stats),
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
        self._recompute: list[float] = []
        self._peak: list[int] = []
        self._norm_count = 0
        self._last: StepRecord | None = None

    def __len__(self) -> int:
        return self.count

    def state(self) -> dict[str, Any]:
        """The sums as plain values (JSON): what a checkpoint carries of a window a stop cut,
        so that the resumed run's line for it covers the same steps as an uninterrupted run's.

        >>> window = Window()
        >>> window.add(StepRecord(3, 2.0, 0.1, 0.5, 8, None, 0.2, 0.2, [0.1], [0.0], 0.5, [1], "m"))
        >>> Window.from_state(window.state()).figures() == window.figures()
        True
        """
        return {
            "count": self.count,
            "sums": dict(self._sums),
            "busy": list(self._busy),
            "recompute": list(self._recompute),
            "peak": list(self._peak),
            "norm_count": self._norm_count,
            "last": asdict(self._last) if self._last is not None else None,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Window:
        """The window :meth:`state` described."""
        window = cls()
        window.count = int(state["count"])
        window._sums = {k: float(v) for k, v in state["sums"].items()}
        window._busy = [float(v) for v in state["busy"]]
        window._recompute = [float(v) for v in state["recompute"]]
        window._peak = [int(v) for v in state["peak"]]
        window._norm_count = int(state["norm_count"])
        window._last = StepRecord(**state["last"]) if state["last"] is not None else None
        return window

    def add(self, record: StepRecord) -> None:
        self.count += 1
        for key in ("loss", "step_time_s", "samples", "bubble", "span_s"):
            self._sums[key] = self._sums.get(key, 0.0) + getattr(record, key)
        self._sums["tokens"] = self._sums.get("tokens", 0.0) + (record.tokens or 0)
        self._busy = [a + b for a, b in zip(self._busy, record.busy_time_s)] or list(
            record.busy_time_s
        )
        self._recompute = [a + b for a, b in zip(self._recompute, record.recompute_time_s)] or list(
            record.recompute_time_s
        )
        self._peak = [max(a, b) for a, b in zip(self._peak, record.peak_memory_bytes)] or list(
            record.peak_memory_bytes
        )
        if record.grad_norm is not None:
            self._norm_count += 1
            self._sums["grad_norm"] = self._sums.get("grad_norm", 0.0) + record.grad_norm
        self._last = record

    def figures(self) -> dict[str, Any]:
        """Mean loss, throughput over the window's total time, mean bubble, max memory, and
        the window's :func:`breakdown` (recompute share, stage imbalance)."""
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
            **breakdown(self._busy, self._recompute, sums["span_s"]),
            "peak_memory_bytes": list(self._peak),
            "memory_kind": last.memory_kind,
            "clock": last.clock,
        }
        if last.tokens is not None:
            figures["tokens_per_s"] = sums["tokens"] / sums["step_time_s"]
        if self._norm_count:
            figures["grad_norm"] = sums["grad_norm"] / self._norm_count
        return figures
