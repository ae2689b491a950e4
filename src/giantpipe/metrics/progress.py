"""How a run shows its progress: a tqdm bar on a terminal, log lines elsewhere (nohup, a
cluster job, CI), so a log that is not a terminal is never silent for long.

Example::

    bar = ProgressBar(total=300, initial=0, style="auto")     # logger.progress
    bar.advance(1, loss="2.1000")
    lines = ProgressLines(total=300, initial=0, every_s=30.0)
    lines.add(step=10, loss=2.1, samples=64, step_time_s=0.02, due=True)
    # 'step 10/300: loss 2.1000, 3200 samples/s, ETA 6s'
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm


def wants_bar(style: str) -> bool:
    """``auto``: a bar when stdout is a terminal; ``tqdm``: always; ``lines``, ``none``: never."""
    if style == "auto":
        return sys.stdout.isatty()
    return style == "tqdm"


def wants_lines(style: str) -> bool:
    """``auto``: lines when stdout is not a terminal; ``lines``: always; else never."""
    if style == "auto":
        return not sys.stdout.isatty()
    return style == "lines"


class ProgressBar:
    """Optimizer steps done out of the total, with the latest loss and throughput."""

    def __init__(self, total: int, initial: int, style: str) -> None:
        self._bar = (
            tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout)
            if wants_bar(style)
            else None
        )

    def advance(self, steps: int, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(steps)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class ProgressLines:
    """One line (step, mean loss, samples/s since the last line, ETA) when a step is ``due``
    (a ``trainer.log_every`` step) or ``every_s`` seconds have passed since the last line.

    A step costs a clock read and three additions; a step longer than ``every_s`` gets a line
    of its own. The ETA extrapolates the wall time per step since the first step this
    process ran (evaluations and saves included), leaving that first step's warm-up out.

    >>> clock = iter([0.0, 1.0, 2.0, 40.0]).__next__
    >>> lines = ProgressLines(total=100, initial=0, every_s=30.0, clock=clock)
    >>> lines.add(step=1, loss=2.0, samples=32, step_time_s=1.0, due=False) is None
    True
    >>> lines.add(step=2, loss=1.0, samples=32, step_time_s=1.0, due=False) is None
    True
    >>> lines.add(step=3, loss=0.5, samples=32, step_time_s=2.0, due=False)
    'step 3/100: loss 1.1667, 24 samples/s, ETA 31m 32s'
    """

    def __init__(
        self,
        total: int,
        initial: int,
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.every_s, self.clock = total, every_s, clock
        self._last_line = clock()
        self._origin: tuple[float, int] | None = None  # (time, step) after the first step
        self._steps, self._loss, self._samples, self._time = 0, 0.0, 0.0, 0.0

    def add(
        self, step: int, loss: float, samples: int, step_time_s: float, due: bool
    ) -> str | None:
        """Accounts one optimizer step; returns the line to log, if one is due."""
        now = self.clock()
        self._steps += 1
        self._loss += loss
        self._samples += samples
        self._time += step_time_s
        if self._origin is None:
            self._origin = (now, step)
        if not due and now - self._last_line < self.every_s:
            return None
        line = (
            f"step {step}/{self.total}: loss {self._loss / self._steps:.4f}, "
            f"{_rate(self._samples, self._time)} samples/s, ETA {self._eta(now, step)}"
        )
        self._last_line = now
        self._steps, self._loss, self._samples, self._time = 0, 0.0, 0.0, 0.0
        return line

    def _eta(self, now: float, step: int) -> str:
        assert self._origin is not None
        since, first = self._origin
        per_step = (now - since) / (step - first) if step > first else self._time / self._steps
        return duration(per_step * max(0, self.total - step))


def _rate(count: float, seconds: float) -> str:
    if seconds <= 0:
        return "-"
    rate = count / seconds
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}"


def duration(seconds: float) -> str:
    """Seconds as a person reads them.

    >>> duration(42.4), duration(192), duration(3725), duration(2 * 86400 + 7200)
    ('42s', '3m 12s', '1h 02m', '2d 02h')
    """
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"
