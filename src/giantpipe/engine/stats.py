"""Where the time and memory of a step went, measured on every step.

Each worker times its own actions (busy time) and counts the activation bytes its stage holds;
the step's span runs from the first action's start to the last action's end. The measured bubble
is the idle share of the K stage-timelines over that span, to compare with the fill-drain
bound (K-1)/(M+K-1).

Example::

    >>> s = StepStats.from_timings(wall=1.0, span=1.0, busy=[0.6, 0.8], peaks=[10, 20],
    ...                            num_microbatches=4, memory_kind="saved_activations")
    >>> round(s.bubble, 2), round(s.expected_bubble, 2)
    (0.3, 0.2)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from giantpipe.engine.schedule import Action, expected_bubble


@dataclass(frozen=True)
class ActionTiming:
    """One action as the executor ran it: ``start`` and ``end`` on ``time.perf_counter``'s
    clock, ``waited`` of it spent waiting for a neighbour's activation or gradient, and
    ``recompute`` of it spent re-materializing the forward (a B of a re-materialized
    micro-batch)."""

    action: Action
    start: float
    end: float
    waited: float = 0.0
    recompute: float = 0.0

    @property
    def work(self) -> float:
        """Seconds of the action spent working (waiting left out)."""
        return self.end - self.start - self.waited


@dataclass(frozen=True)
class StepStats:
    """Measurements of one pipelined step (forward + backward)."""

    wall_time_s: float  # as seen by the caller, scatter and gather included
    span_s: float  # first action start to last action end (excludes the user's loss, front door)
    busy_time_s: list[float]  # per stage: time spent running its actions
    bubble: float  # measured idle fraction: 1 - sum(busy) / (K * span)
    expected_bubble: float  # (K-1)/(M+K-1)
    peak_memory_bytes: list[int]  # per stage; see memory_kind
    memory_kind: str  # "cuda_allocator" or "saved_activations" (bytes saved for backward)
    num_microbatches: int

    @classmethod
    def from_timings(
        cls,
        wall: float,
        span: float,
        busy: list[float],
        peaks: list[int],
        num_microbatches: int,
        memory_kind: str,
    ) -> StepStats:
        k = len(busy)
        bubble = 1.0 - sum(busy) / (k * span) if span > 0 else 0.0
        return cls(
            wall_time_s=wall,
            span_s=span,
            busy_time_s=list(busy),
            bubble=max(0.0, bubble),
            expected_bubble=expected_bubble(k, num_microbatches),
            peak_memory_bytes=list(peaks),
            memory_kind=memory_kind,
            num_microbatches=num_microbatches,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
