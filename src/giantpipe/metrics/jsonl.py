"""``metrics.jsonl``: one JSON object per line, appended and flushed as training goes.

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
    """All records of a JSONL file (an absent file has none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_after_step(path: Path, step: int) -> None:
    """Drop lines past ``step``: a resumed run rewrites them, so the file holds one trajectory."""
    records = read_jsonl(path)
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    if len(kept) == len(records):
        return
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


class JsonlSink:
    """Appends records to a JSONL file, one flushed line each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._handle.write(json.dumps({k: json_safe(v) for k, v in record.items()}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()
