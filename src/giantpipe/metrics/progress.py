"""The progress bar: tqdm on a terminal, silent when stdout is not one (logs, CI, sweeps).

Example::

    bar = ProgressBar(total=300, initial=0, style="auto")   # logger.progress
    bar.advance(1, loss="2.1000")
    bar.close()
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def wants_bar(style: str) -> bool:
    """``auto``: only when stdout is a terminal; ``tqdm``: always; ``none``: never."""
    if style == "auto":
        return sys.stdout.isatty()
    return style == "tqdm"


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
