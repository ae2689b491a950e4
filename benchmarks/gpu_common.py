"""What a case of the GPU check reports: rows of a table, each a check, its verdict, what was
measured and the criterion (a GPU test's row, or a measurement's: gpu_perf.py, gpu_speed.py),
and what became of the case (:class:`CaseResult`).

A verdict is pass or FAIL, or says why it is not judged here (``info``: printed only; ``CUDA
only``, ``needs 2 GPUs``: see :mod:`giantpipe.testing.gpu`; ``no band yet``: a measured row whose
band no GPU run has set, gpu_bands.py). benchmarks/gpu_check.py prints every measurement's rows
as a markdown table beside the GPU tests' own.

Example::

    section = Section()
    section.banded("recompute never: measured/forecast", ratios, f"{ratios[0]:.2f}", "both")
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Row = tuple[str, str, str, str]  # check, verdict, measured, criterion
PASS, FAIL, INFO, NO_BAND = "pass", "FAIL", "info", "no band yet"


@dataclass
class Section:
    """What a measurement reports: rows of a markdown table, notes under it, and the values of
    the rows a band judges (by check: ``judged``, each must lie in the band; ``seen``, what a
    proposed band spans; ``sided``: ``"both"`` or ``"floor"``)."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, check: str, verdict: str | bool, measured: str, criterion: str) -> None:
        """One row; a bool verdict is pass/FAIL."""
        if isinstance(verdict, bool):
            verdict = PASS if verdict else FAIL
        self.rows.append((check, verdict, measured, criterion))

    def banded(
        self,
        check: str,
        judged: Sequence[float],
        shown: str,
        sided: str,
        seen: Sequence[float] | None = None,
    ) -> None:
        """A measured row judged by a band set from a GPU run's data (gpu_bands.py), not by a
        criterion in code: "no band yet" until gpu_check applies one."""
        self.rows.append((check, NO_BAND, shown, "-"))
        values = list(judged if seen is None else seen)
        self.measured[check] = {"judged": list(judged), "seen": values, "sided": sided}


@dataclass
class CaseResult:
    """What became of one case: rows, or why there are none (timeout, crash, exception)."""

    name: str
    seconds: float
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)  # as Section's
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
        """TIMEOUT, ERROR or CRASH; FAIL; pass when a row passed (``pass, N no band yet`` when
        some measured rows had no band); ``no band yet`` when rows were measured but none
        judged; else ``not run (needs 2 GPUs)``: what this machine cannot prove is no pass."""
        if self.problem is not None:
            return {"timed": "TIMEOUT", "raised": "ERROR"}.get(self.problem.split()[0], "CRASH")
        if self.failed:
            return FAIL
        verdicts = [row[1] for row in self.rows]
        unbanded = verdicts.count(NO_BAND)
        if PASS in verdicts:
            return f"{PASS}, {unbanded} {NO_BAND}" if unbanded else PASS
        if unbanded:
            return NO_BAND
        reasons = sorted(set(verdicts) - {INFO})
        return f"not run ({', '.join(reasons)})" if reasons else INFO


def attempt(section: Section, check: str, criterion: str, run: Callable[[], None]) -> None:
    """Runs ``run`` (which adds its own rows); if it raises, one FAIL row naming the exception
    (its traceback goes to the log): one broken configuration hides no other's rows."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        traceback.print_exc()
        first = str(exc).splitlines()[0][:100] if str(exc) else ""
        section.add(check, False, f"raised {type(exc).__name__}: {first}", criterion)
