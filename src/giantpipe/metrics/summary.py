"""The run's summary: its labels, the two-column table printed at the end, ``summary.json``.

Example::

    write_summary(run_dir / "summary.json", {"steps": 300, "eval/loss": 0.31})
    print(format_table({"steps": 300, "eval/loss": 0.31}))
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from giantpipe.config import human_bytes
from giantpipe.metrics.jsonl import json_safe

_LABELS = {
    "name": "experiment",
    "status": "status",
    "steps": "optimizer steps",
    "wall_time_s": "wall time (s)",
    "stopped_early": "stopped early",
    "train/loss": "train loss (last window)",
    "eval/loss": "eval loss",
    "eval/accuracy": "eval accuracy",
    "eval/top5": "eval top-5 accuracy",
    "train/samples_per_s": "samples/s",
    "train/tokens_per_s": "tokens/s",
    "train/step_time_s": "step time (s)",
    "pipeline/executor": "executor",
    "pipeline/world_size": "processes",
    "pipeline/replicas": "replicas (R)",
    "pipeline/devices": "devices",
    "pipeline/balance": "balance",
    "pipeline/chunks": "chunks (M)",
    "pipeline/bubble": "bubble, measured",
    "pipeline/expected_bubble": "bubble, expected (K-1)/(M+K-1)",
    "pipeline/busy_time_s": "busy time per stage (s/step)",
    "pipeline/recompute_share": "re-materialization, share of the step",
    "pipeline/stage_imbalance": "stage imbalance, busiest / mean busy - 1",
    "pipeline/peak_memory_bytes": "peak memory per stage",
    "pipeline/memory_kind": "memory measured as",
    "pipeline/clock": "stages timed by",
    "pipeline/step_time_s": "engine step (s), measured",
    "pipeline/predicted_step_time_s": "engine step (s), predicted",
    "pipeline/step_time_vs_predicted": "engine step, measured / predicted - 1",
    "pipeline/predicted_bubble": "bubble, predicted (simulator)",
    "pipeline/predicted_peak_memory_bytes": "peak memory per device, predicted (+ weights, grads)",
    "pipeline/predict_time_s": "prediction cost (s, profile + simulation)",
    "pipeline/plan_choice": "plan (pipeline.plan=auto)",
    "checkpoints/kept": "checkpoint kept",
    "checkpoints/removed": "checkpoints removed",
}


def _format(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, list):
        return ", ".join(human_bytes(v, decimals=1) for v in value)
    if key.endswith("_bytes") and isinstance(value, int | float):
        return human_bytes(value, decimals=1)
    if isinstance(value, list):
        return ", ".join(_format(key, v) for v in value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(summary: dict[str, Any]) -> str:
    """A two-column text table of the summary, in a fixed order (unknown keys last).

    Example::

        print(format_table({"steps": 5, "eval/loss": 0.5}))
    """
    keys = [k for k in _LABELS if k in summary] + [k for k in summary if k not in _LABELS]
    rows = []
    for key in keys:
        label, value = _LABELS.get(key, key), summary[key]
        if isinstance(value, dict):  # one row per entry, e.g. the planner's choice
            rows += [(f"{label}: {k}", _format(k, v)) for k, v in value.items()]
        else:
            rows.append((label, _format(key, value)))
    width = max(len(label) for label, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    lines = [rule] + [f"{label.ljust(width)}  {value}" for label, value in rows] + [rule]
    return "\n".join(lines)


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write ``summary.json`` (NaN/inf as strings, so it stays valid JSON) atomically."""
    clean = {k: json_safe(v) for k, v in summary.items()}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(clean, indent=2) + "\n")
    os.replace(tmp, path)
