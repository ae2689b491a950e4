"""The GPU check's acceptance bands: a measured row's pass/FAIL range, set from a GPU run's data.

A measurement (memory, speed against the peers, overlap) reports its value; the band it is
judged by lives in ``results/gpu/bands.json``, per setting of the run (its sizes and GPUs), each
with the report it was set from. Without one the row prints its value and "no band yet"; every
run proposes bands from what it measured. Why and how: results/gpu/README.md.

Example::

    bands = load(BANDS)                               # {setting: {"case: check": Band}}
    judge(case, bands.get(setting(opts), {}))         # each measured row: pass, FAIL or no band
    print(proposals([case], setting(opts), "gpu_check_2027-01-05_1010_full.md"))
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_common import FAIL, NO_BAND, PASS, CaseResult

from giantpipe.testing.gpu import GpuOptions

BANDS = Path(__file__).resolve().parents[1] / "results" / "gpu" / "bands.json"
MARGIN = 0.1  # a proposed band: 10% beyond the range a run measured (rounds, devices)


@dataclass(frozen=True)
class Band:
    """Where a measured value must lie (``None``: no limit on that side), and the report whose
    data set it."""

    low: float | None
    high: float | None
    source: str

    def holds(self, values: Sequence[float]) -> bool:
        """Whether every value lies in the band.

        >>> Band(0.9, None, "r.md").holds([0.95, 1.4]), Band(0.9, 1.1, "r.md").holds([1.2])
        (True, False)
        """
        low = -math.inf if self.low is None else self.low
        high = math.inf if self.high is None else self.high
        return all(low <= v <= high for v in values)

    def text(self) -> str:
        """The band as a criterion, e.g. ``0.85-1.10 (set from r.md)``, ``>= 0.85 (...)``."""
        if self.high is None:
            limits = f">= {self.low:.2f}"
        elif self.low is None:
            limits = f"<= {self.high:.2f}"
        else:
            limits = f"{self.low:.2f}-{self.high:.2f}"
        return f"{limits} (set from {self.source})"


def setting(opts: GpuOptions) -> str:
    """What a band holds for: the run's sizes and GPUs (a ratio at other sizes or on another
    number of GPUs is another quantity).

    >>> setting(GpuOptions(dry=False, quick=True, gpus=1)), setting(GpuOptions(True, True, 0))
    ('quick, 1 GPU', 'CPU stand-ins')
    """
    if opts.dry:
        return "CPU stand-ins"
    return f"{'quick' if opts.quick else 'full'}, {opts.gpus} GPU{'s' if opts.gpus > 1 else ''}"


def load(path: Path) -> dict[str, dict[str, Band]]:
    """The bands in ``path`` by setting, then by ``"case: check"``; none if it does not exist.
    A file that does not read as bands raises ValueError naming the file and the entry."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("bands"), dict):
        raise ValueError(f'{path}: expected {{"bands": {{SETTING: {{"CASE: CHECK": BAND}}}}}}')
    return {
        name: {key: _band(path, f"{name} / {key}", entry) for key, entry in checks.items()}
        for name, checks in data["bands"].items()
    }


def _band(path: Path, where: str, entry: Any) -> Band:
    keys = {"low", "high", "from"}
    if not isinstance(entry, dict) or set(entry) != keys:
        raise ValueError(f"{path}: {where}: expected the keys {sorted(keys)}")
    low, high = entry["low"], entry["high"]
    numbers = all(v is None or isinstance(v, int | float) for v in (low, high))
    if not numbers or (low is None and high is None):
        raise ValueError(f"{path}: {where}: low and high are numbers or null, not both null")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{path}: {where}: low {low} is above high {high}")
    return Band(low, high, str(entry["from"]))


def judge(case: CaseResult, bands: dict[str, Band]) -> None:
    """Gives each measured row of ``case`` its verdict: pass or FAIL against its band, else
    "no band yet" (the value printed, nothing judged)."""
    for row in case.rows:
        measured = case.measured.get(row[0])
        if measured is None:
            continue
        band = bands.get(f"{case.name}: {row[0]}")
        if band is None:
            row[1], row[3] = NO_BAND, "a GPU run's data sets it (results/gpu/README.md)"
        else:
            row[1], row[3] = (PASS if band.holds(measured["judged"]) else FAIL), band.text()


def proposed(seen: Sequence[float], sided: str) -> dict[str, float | None]:
    """The band a run proposes from the values it ``seen``: :data:`MARGIN` beyond their range
    on both sides (``sided="both"``), or below their least (``"floor"``).

    >>> proposed([1.0, 1.2], "both"), proposed([0.8, 1.0], "floor")
    ({'low': 0.9, 'high': 1.32}, {'low': 0.72, 'high': None})
    """
    low = round(min(seen) * (1 - MARGIN), 2)
    high = round(max(seen) * (1 + MARGIN), 2) if sided == "both" else None
    return {"low": low, "high": high}


def proposals(cases: Sequence[CaseResult], where: str, source: str) -> str:
    """Markdown: the bands this run proposes for setting ``where``, as the JSON entries that
    ``results/gpu/bands.json`` takes (``source``: the report they come from)."""
    entries = {
        f"{case.name}: {check}": {**proposed(m["seen"], m["sided"]), "from": source}
        for case in cases
        for check, m in case.measured.items()
        if m["seen"] and all(math.isfinite(v) for v in m["seen"])
    }
    lines = ["## Bands this run proposes", ""]
    if not entries:
        return "\n".join([*lines, "None: no measured row.", ""])
    if where == "CPU stand-ins":
        lines.append("From CPU stand-ins: they show the mechanism, they are no GPU's bands.")
    else:
        lines.append(
            "Read the rows above first; to judge later runs of this setting by them, add these "
            'entries to results/gpu/bands.json\'s "bands" (results/gpu/README.md).'
        )
    rows = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in entries.items()]
    block = ["{", f"  {json.dumps(where)}: {{", ",\n".join(rows), "  }", "}"]
    return "\n".join([*lines, "", "```json", *block, "```", ""])
