"""Where metrics go: a progress bar on the terminal, ``metrics.jsonl``, W&B (opt-in), and at the
end ``summary.json`` with the same figures as a table on stdout.

- :class:`ProgressBar`: tqdm on a terminal; silent when stdout is not one (logs, CI, sweeps);
- :class:`JsonlSink`: one JSON object per line, appended and flushed as training goes
  (:func:`read_jsonl` reads it back, :func:`truncate_after_step` trims it for a resume);
- :class:`WandbSink`: Weights & Biases (``logger=wandb``); offline mode needs no network; each
  run (each sweep job too) opens its own W&B run and finishes it in :meth:`WandbSink.close`;
- :func:`write_summary` and :func:`format_table`: the end-of-run summary.

Example::

    bar = ProgressBar(total=300, initial=0, style="auto")
    sink = JsonlSink(run_dir / "metrics.jsonl")
    sink.write({"kind": "train", "step": 10, "loss": 1.9})
    read_jsonl(run_dir / "metrics.jsonl")    # [{"kind": "train", "step": 10, "loss": 1.9}]
    wandb = WandbSink(project="giantpipe", mode="offline", run_dir=run_dir, name="k2_m4",
                      config=asdict(cfg))
    write_summary(run_dir / "summary.json", {"steps": 300, "eval/loss": 0.31})
    print(format_table({"steps": 300, "eval/loss": 0.31}))
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

# --------------------------------------------------------------------------- progress bar


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


# --------------------------------------------------------------------------- metrics.jsonl


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


def truncate_after_step(path: Path, step: int) -> int:
    """Cuts ``path`` back to the records up to ``step`` (a torn last line goes too): a resumed
    run writes the rest again, so every step appears once. Returns how many lines went."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
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


# --------------------------------------------------------------------------- Weights & Biases


class WandbSink:
    """Logs records to a W&B run; ``wandb`` is imported only when this sink is used."""

    def __init__(
        self, project: str, mode: str, run_dir: Path, name: str, config: dict[str, Any]
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("logger=wandb needs wandb: pip install 'giantpipe[wandb]'") from err
        self._wandb = wandb
        self._run = wandb.init(
            project=project,
            mode=mode,  # type: ignore[arg-type]  # one of LoggerConfig's WANDB_MODES
            dir=str(run_dir),
            name=name,
            config=config,
        )

    def log(self, record: dict[str, Any], step: int) -> None:
        flat = {k: v for k, v in record.items() if isinstance(v, int | float)}
        for key, values in record.items():
            if isinstance(values, list):  # per-stage figures become stage-indexed scalars
                flat.update({f"{key}/stage{i}": v for i, v in enumerate(values)})
        self._run.log(flat, step=step)

    def close(self, summary: dict[str, Any]) -> None:
        self._run.summary.update({k: v for k, v in summary.items() if not isinstance(v, list)})
        self._wandb.finish()


# --------------------------------------------------------------------------- summary.json

_LABELS = {
    "name": "experiment",
    "status": "status",
    "steps": "optimizer steps",
    "wall_time_s": "wall time (s)",
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
}


def _human_bytes(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"


def _format(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, list):
        return ", ".join(_human_bytes(v) for v in value)
    if key.endswith("_bytes") and isinstance(value, int | float):
        return _human_bytes(value)
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
