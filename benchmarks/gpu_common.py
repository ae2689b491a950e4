"""What a case of the GPU check reports: rows of a table, each a check, its verdict, what was
measured and the criterion (a GPU test's row, or a measurement's: gpu_perf.py, gpu_speed.py),
and what became of the case (:class:`CaseResult`).

A verdict is pass or FAIL, or says why it is not judged here (``info``: printed only; ``CUDA
only``, ``needs 2 GPUs``: see :mod:`giantpipe.testing.gpu`). benchmarks/gpu_check.py prints
every measurement's rows as a markdown table beside the GPU tests' own.

Example::

    section = Section()
    section.add("recompute never: measured/forecast", ok, f"{ratio:.2f}", "0.75-1.33 per device")
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

Row = tuple[str, str, str, str]  # check, verdict, measured, criterion
PASS, FAIL, INFO = "pass", "FAIL", "info"


@dataclass
class Section:
    """What a measurement reports: rows of a markdown table, and notes under it."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, check: str, verdict: str | bool, measured: str, criterion: str) -> None:
        """One row; a bool verdict is pass/FAIL."""
        if isinstance(verdict, bool):
            verdict = PASS if verdict else FAIL
        self.rows.append((check, verdict, measured, criterion))


@dataclass
class CaseResult:
    """What became of one case: rows, or why there are none (timeout, crash, exception)."""

    name: str
    seconds: float
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problem: str | None = None  # "timed out after 5 s", "raised an exception", "crashed (exit -11)"
    log: str = ""  # the case's output: the traceback or every thread's stack

    @property
    def failed(self) -> list[str]:
        """The checks that failed (the whole case, if it has no rows)."""
        if self.problem is not None:
            return [f"{self.name}: {self.problem}"]
        return [f"{self.name}: {row[0]}" for row in self.rows if row[1] == FAIL]

    @property
    def verdict(self) -> str:
        """TIMEOUT, ERROR or CRASH; FAIL; ``not run (needs 2 GPUs)`` when no row was judged
        here (every verdict a reason: what this machine cannot prove is not a pass); pass."""
        if self.problem is not None:
            return {"timed": "TIMEOUT", "raised": "ERROR"}.get(self.problem.split()[0], "CRASH")
        if self.failed:
            return FAIL
        reasons = sorted({row[1] for row in self.rows} - {PASS, INFO})
        if self.rows and len(reasons) == len({row[1] for row in self.rows}):
            return f"not run ({', '.join(reasons)})"
        return PASS


def attempt(section: Section, check: str, criterion: str, run: Callable[[], None]) -> None:
    """Runs ``run`` (which adds its own rows); if it raises, one FAIL row naming the exception
    (its traceback goes to the log): one broken configuration hides no other's rows."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        traceback.print_exc()
        first = str(exc).splitlines()[0][:100] if str(exc) else ""
        section.add(check, False, f"raised {type(exc).__name__}: {first}", criterion)
