"""metrics.jsonl: one JSON object per line, appended and flushed as training goes.

:class:`JsonlSink` writes it, :func:`read_jsonl` reads it back (the runner for ``curves.png``,
scripts and tests), :func:`truncate_after_step` trims it for a resume; :func:`json_safe` keeps
NaN and inf valid JSON (``summary.json`` uses it too).

Example::

    sink = JsonlSink(run_dir / "metrics.jsonl")
    sink.write({"kind": "train", "step": 10, "loss": 1.9})
    read_jsonl(run_dir / "metrics.jsonl")    # [{"kind": "train", "step": 10, "loss": 1.9}]
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings ("nan"), so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All records of a JSONL file (an absent file has none). A line that is not JSON is left
    out: a write cut short by a full disk or a killed process leaves one at the end."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in records if isinstance(r, dict)]


def truncate_after_step(path: Path, step: int, partial_too: bool = False) -> int:
    """Cuts ``path`` back to the records up to ``step`` (a torn last line goes too): a resumed
    run writes the rest again, so every step appears once. ``partial_too``: the lines of cut
    windows go too (the resumed run goes on with their window and writes it whole). Returns how
    many lines went."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = [
        r
        for r in read_jsonl(path)
        if int(r.get("step", 0)) <= step and not (partial_too and r.get("partial"))
    ]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


class JsonlSink:
    """Appends records to a JSONL file, one flushed line each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._handle.write(json.dumps({k: json_safe(v) for k, v in record.items()}) + "\n")
            self._handle.flush()
        except OSError as err:  # a full disk: name the file
            raise OSError(err.errno, err.strerror, str(self.path)) from err

    def close(self) -> None:
        self._handle.close()
