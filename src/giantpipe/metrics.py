"""Metrics: what an optimizer step reports and where it goes.

One optimizer step's figures (:class:`StepRecord`), the :class:`Window` that averages them, and
:class:`MetricsLogger`, the training loop's one door to the sinks:

- :class:`ProgressBar`: tqdm on a terminal; silent when stdout is not one (logs, CI, sweeps);
- :class:`JsonlSink`: one JSON object per line, appended and flushed as training goes
  (:func:`read_jsonl` reads it back, :func:`truncate_after_step` trims it for a resume);
- :class:`WandbSink`: Weights & Biases (``logger=wandb``); offline mode needs no network; each
  run (each sweep job too) opens its own W&B run and finishes it in :meth:`WandbSink.close`;
- :class:`TensorBoardSink`: a TensorBoard event file in ``RUN_DIR/tensorboard``
  (``logger.tensorboard=true``; ``tensorboard --logdir outputs`` shows every run);
- :func:`write_summary` and :func:`format_table`: the end-of-run summary;
- :func:`plot_curves`: ``curves.png``, the training loss and the evaluation figures against the
  step, drawn when a run closes (beside the timelines);
- :func:`write_sweep_table`: at the end of a multirun, ``sweep.md`` / ``sweep.csv`` (each job's
  overrides, status and objective) and ``sweep.png`` (the objective against each swept key).

Imported by the runner (and scripts reading ``metrics.jsonl``); imports nothing of giantpipe
but ``giantpipe.config`` (the engine's step statistics are duck-typed, see :class:`EngineStats`).

Example::

    window = Window()
    window.add(StepRecord(step=1, loss=2.1, lr=1e-3, step_time_s=0.02, samples=64, ...))
    window.figures()   # {"loss": 2.1, "samples_per_s": 3200.0, "bubble": ..., ...}

    metrics = MetricsLogger(cfg.logger, run_dir, total_steps=300, start_step=0, log_every=20,
                            name="mlp_quickstart", config=asdict(cfg))
    metrics.train_step(record)                    # every optimizer step
    metrics.evaluation(step, {"loss": 0.4, "accuracy": 0.9})
    metrics.close(summary)

    sink = JsonlSink(run_dir / "metrics.jsonl")
    sink.write({"kind": "train", "step": 10, "loss": 1.9})
    read_jsonl(run_dir / "metrics.jsonl")    # [{"kind": "train", "step": 10, "loss": 1.9}]
    write_summary(run_dir / "summary.json", {"steps": 300, "eval/loss": 0.31})
    print(format_table({"steps": 300, "eval/loss": 0.31}))
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from giantpipe.config import LoggerConfig

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


# --------------------------------------------------------------------------- TensorBoard


class TensorBoardSink:
    """Scalars to a TensorBoard event file under ``log_dir`` (``torch.utils.tensorboard``, which
    needs the ``tensorboard`` package: ``pip install 'giantpipe[tensorboard]'``).

    Example::

        sink = TensorBoardSink(run_dir / "tensorboard")
        sink.log({"train/loss": 1.9, "train/busy_time_s": [0.1, 0.2]}, step=10)
        sink.close()          # tensorboard --logdir outputs
    """

    def __init__(self, log_dir: Path, resumed_at: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "logger.tensorboard=true needs tensorboard: pip install 'giantpipe[tensorboard]'"
            ) from err
        # A resumed run hides the events past its checkpoint that the interrupted one wrote,
        # as metrics.jsonl is cut back: every step is shown once.
        purge = resumed_at + 1 if resumed_at else None
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in record.items():
            if isinstance(value, bool) or not isinstance(value, int | float | list):
                continue
            values = value if isinstance(value, list) else [value]
            names = (
                [f"{key}/stage{i}" for i in range(len(values))]
                if isinstance(value, list)
                else [key]
            )
            for name, number in zip(names, values):
                if isinstance(number, int | float) and not isinstance(number, bool):
                    self._writer.add_scalar(name, number, global_step=step)
        self._writer.flush()  # a crash loses nothing already logged

    def close(self) -> None:
        self._writer.close()


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


# --------------------------------------------------------------------------- pictures


def _pyplot() -> Any:
    import matplotlib  # imported here: only the pictures need it

    matplotlib.use("Agg")  # files only, never a window (servers have no display)
    import matplotlib.pyplot as plt

    return plt


def plot_curves(records: list[dict[str, Any]], path: Path) -> Path | None:
    """``path`` (PNG): training loss and every evaluation figure against the optimizer step,
    from metrics.jsonl's records; the evaluation figures on a panel of their own. None when
    there is nothing to draw.

    Example::

        plot_curves(read_jsonl(run_dir / "metrics.jsonl"), run_dir / "curves.png")
    """
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and "loss" in r]
    evals = [r for r in records if r.get("kind") == "eval"]
    names = sorted(  # besides the loss, which shares the training loss's panel
        {k for r in evals for k, v in r.items() if k not in ("kind", "step", "loss") and _number(v)}
    )
    if not train and not evals:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if names else 1, figsize=(11 if names else 6, 4), squeeze=False)
    loss_ax = axes[0][0]
    if train:
        loss_ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if any("loss" in r for r in evals):
        points = [(r["step"], r["loss"]) for r in evals if "loss" in r]
        loss_ax.plot(*zip(*points), "o-", label="eval loss", color="tab:red")
    loss_ax.set(xlabel="optimizer step", ylabel="loss", title="loss")
    loss_ax.legend()
    if names:
        other = axes[0][1]
        for name in names:
            points = [(r["step"], r[name]) for r in evals if _number(r.get(name))]
            other.plot(*zip(*points), "o-", label=f"eval {name}")
        other.set(xlabel="optimizer step", title="evaluation")
        other.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _as_float(value: Any) -> float:
    """A summary value as a number; nan for text that is not one (``"nan"`` reads as nan)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _overrides(config_yaml: Path) -> dict[str, str]:
    """``key=value`` pairs of the ``# overrides:`` line the runner heads config.yaml with."""
    first = config_yaml.read_text().partition("\n")[0] if config_yaml.is_file() else ""
    words = first.removeprefix("# overrides:").split() if first.startswith("# overrides:") else []
    return dict(w.split("=", 1) for w in words if "=" in w)


def sweep_rows(
    sweep_dir: Path, objective: str, launched: dict[int, list[str]] | None = None
) -> list[dict[str, Any]]:
    """One row per job of a multirun: the job directories (``0``, ``1``, ...) with their
    overrides (config.yaml's first line), status and ``objective`` (summary.json), and the jobs of
    ``launched`` (number -> overrides, as Hydra launched them) that left no directory: refused
    configs, whose directory the entry point removes (status ``refused``, objective nan)."""
    jobs = {int(d.name): d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()}
    rows = []
    for number in sorted(set(jobs) | set(launched or {})):
        summary: dict[str, Any] = {"status": "refused"}
        overrides = dict(
            o.lstrip("+").split("=", 1) for o in (launched or {}).get(number, []) if "=" in o
        )
        if number in jobs:
            overrides = _overrides(jobs[number] / "config.yaml") or overrides
            try:
                summary = json.loads((jobs[number] / "summary.json").read_text())
            except (OSError, ValueError):
                summary = {"status": "missing"}
        value = summary.get(objective, math.nan)
        row: dict[str, Any] = {"job": number, **overrides, "status": summary.get("status")}
        row[objective] = _as_float(value)
        rows.append(row)
    return rows


def write_sweep_table(
    sweep_dir: Path, objective: str, launched: dict[int, list[str]] | None = None
) -> list[Path]:
    """``sweep.md``, ``sweep.csv`` and ``sweep.png`` in ``sweep_dir``: each job's swept keys (the
    overrides that differ between jobs), status and objective, and the objective plotted against
    each swept key. Returns the files written (none for a directory without jobs).

    Example::

        write_sweep_table(Path("outputs/multirun/2026-12-03/13-05-00"), "eval/loss")
        # | job | pipeline.chunks | status | eval/loss |
        # | 0   | 1               | completed | 0.52 |
    """
    rows = sweep_rows(sweep_dir, objective, launched)
    if not rows:
        return []
    keys = [
        k
        for k in dict.fromkeys(k for r in rows for k in r)
        if k not in ("job", "status", objective)
    ]
    swept = [k for k in keys if len({str(r.get(k)) for r in rows}) > 1] or keys
    columns = ["job", *swept, "status", objective]
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(line) + " |" for line in cells]
    md, csv = sweep_dir / "sweep.md", sweep_dir / "sweep.csv"
    md.write_text(f"Sweep {sweep_dir}: {objective} per job\n\n" + "\n".join(table) + "\n")
    csv.write_text("\n".join(",".join(_csv(c) for c in line) for line in [columns, *cells]) + "\n")
    written = [md, csv]
    picture = _plot_sweep(rows, swept, objective, sweep_dir / "sweep.png")
    return written + ([picture] if picture else [])


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _csv(text: str) -> str:
    return f'"{text}"' if any(c in text for c in ',"') else text


def _plot_sweep(
    rows: list[dict[str, Any]], swept: list[str], objective: str, path: Path
) -> Path | None:
    """The objective against each swept key, one panel per key (numbers on a numeric axis,
    anything else as categories)."""
    if not swept:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(swept), figsize=(4.5 * len(swept), 3.8), squeeze=False)
    for ax, key in zip(axes[0], swept):
        points = [(str(r.get(key, "")), r[objective]) for r in rows]
        try:
            xs: list[Any] = [float(x) for x, _ in points]
        except ValueError:
            xs = [x for x, _ in points]
        ax.plot(xs, [y for _, y in points], "o")
        ax.set(xlabel=key, ylabel=objective)
    fig.suptitle(f"{objective} per job")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class EngineStats(Protocol):
    """What the engine reports after a step (``pipe.last_stats``); duck-typed, no engine import."""

    wall_time_s: float
    span_s: float
    busy_time_s: list[float]
    recompute_time_s: list[float]
    bubble: float
    expected_bubble: float
    peak_memory_bytes: list[int]
    memory_kind: str
    clock: str


def breakdown(busy: Sequence[float], recompute: Sequence[float], span: float) -> dict[str, float]:
    """Where a pipeline's time went, as the paper's Section 3.1 reads it, over K stage
    timelines of ``span`` seconds each (sums over as many steps as you like).

    - ``recompute_share``: re-materialization's share of the K timelines,
      sum(recompute) / (K x span); the paper reports up to 23% of the step;
    - ``stage_imbalance``: the busiest stage over the mean one, minus 1 (3.2% at K=2 in the
      paper): what a better balance could win back.

    The measured ``bubble`` (1 - sum(busy) / (K x span)) and its bound (K-1)/(M+K-1) come with
    every step already (:class:`StepRecord`): the paper's bubble is below the bound because
    recomputation runs while a stage would otherwise wait.

    >>> {k: round(v, 3) for k, v in breakdown([0.6, 0.8], [0.1, 0.2], span=1.0).items()}
    {'recompute_share': 0.15, 'stage_imbalance': 0.143}
    """
    k = len(busy)
    mean = sum(busy) / k if k else 0.0
    return {
        "recompute_share": sum(recompute) / (k * span) if k and span > 0 else 0.0,
        "stage_imbalance": max(busy) / mean - 1.0 if mean > 0 else 0.0,
    }


@dataclass
class StepRecord:
    """Figures of one optimizer step (several engine steps when accumulating gradients)."""

    step: int
    loss: float
    lr: float
    step_time_s: float
    """Wall time of the whole optimizer step: engine steps, clipping, update."""
    samples: int
    tokens: int | None
    bubble: float
    """Measured idle fraction of the stages, averaged over the engine steps."""
    expected_bubble: float
    """(K - 1) / (M + K - 1)."""
    busy_time_s: list[float]
    """Per stage: seconds spent computing, summed over the engine steps."""
    recompute_time_s: list[float]
    """Per stage: of the busy seconds, those spent re-materializing forwards."""
    span_s: float
    """Seconds from the first action to the last, summed over the engine steps."""
    peak_memory_bytes: list[int]
    """Per stage: the highest peak of the engine steps."""
    memory_kind: str
    grad_norm: float | None = None
    clock: str = "perf_counter"
    """What timed the stages: ``perf_counter`` (CPU) or ``cuda_events`` (the kernels' time)."""

    @classmethod
    def from_engine(cls, stats: list[EngineStats], **figures: Any) -> StepRecord:
        """Merge the engine's stats of the step's engine steps into one record.

        Example::

            StepRecord.from_engine([pipe.last_stats], step=3, loss=0.7, lr=1e-3,
                                   step_time_s=0.05, samples=64, tokens=None)
        """
        stages = len(stats[0].busy_time_s)
        return cls(
            bubble=sum(s.bubble for s in stats) / len(stats),
            expected_bubble=stats[0].expected_bubble,
            busy_time_s=[sum(s.busy_time_s[i] for s in stats) for i in range(stages)],
            recompute_time_s=[sum(s.recompute_time_s[i] for s in stats) for i in range(stages)],
            span_s=sum(s.span_s for s in stats),
            peak_memory_bytes=[max(s.peak_memory_bytes[i] for s in stats) for i in range(stages)],
            memory_kind=stats[0].memory_kind,
            clock=stats[0].clock,
            **figures,
        )


class Window:
    """Running sums over records (since the last log line, or over the whole run).

    Sums rather than a list of records, so a run-long window costs constant memory.
    """

    def __init__(self) -> None:
        self.count = 0
        self._sums: dict[str, float] = {}
        self._busy: list[float] = []
        self._recompute: list[float] = []
        self._peak: list[int] = []
        self._norm_count = 0
        self._last: StepRecord | None = None

    def __len__(self) -> int:
        return self.count

    def add(self, record: StepRecord) -> None:
        self.count += 1
        for key in ("loss", "step_time_s", "samples", "bubble", "span_s"):
            self._sums[key] = self._sums.get(key, 0.0) + getattr(record, key)
        self._sums["tokens"] = self._sums.get("tokens", 0.0) + (record.tokens or 0)
        self._busy = [a + b for a, b in zip(self._busy, record.busy_time_s)] or list(
            record.busy_time_s
        )
        self._recompute = [a + b for a, b in zip(self._recompute, record.recompute_time_s)] or list(
            record.recompute_time_s
        )
        self._peak = [max(a, b) for a, b in zip(self._peak, record.peak_memory_bytes)] or list(
            record.peak_memory_bytes
        )
        if record.grad_norm is not None:
            self._norm_count += 1
            self._sums["grad_norm"] = self._sums.get("grad_norm", 0.0) + record.grad_norm
        self._last = record

    def figures(self) -> dict[str, Any]:
        """Mean loss, throughput over the window's total time, mean bubble, max memory, and
        the window's :func:`breakdown` (recompute share, stage imbalance)."""
        last, n, sums = self._last, self.count, self._sums
        assert last is not None, "figures() of an empty window"
        figures: dict[str, Any] = {
            "loss": sums["loss"] / n,
            "lr": last.lr,
            "samples_per_s": sums["samples"] / sums["step_time_s"],
            "step_time_s": sums["step_time_s"] / n,
            "bubble": sums["bubble"] / n,
            "expected_bubble": last.expected_bubble,
            "busy_time_s": [b / n for b in self._busy],
            **breakdown(self._busy, self._recompute, sums["span_s"]),
            "peak_memory_bytes": list(self._peak),
            "memory_kind": last.memory_kind,
            "clock": last.clock,
        }
        if last.tokens is not None:
            figures["tokens_per_s"] = sums["tokens"] / sums["step_time_s"]
        if self._norm_count:
            figures["grad_norm"] = sums["grad_norm"] / self._norm_count
        return figures


# ---- the loop's door to the sinks ----------------------------------------------------------

log = logging.getLogger(__name__)


class MetricsLogger:
    """Fans records out to the configured sinks and keeps run-long figures."""

    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        log_every: int,
        name: str,
        config: dict[str, Any],
    ) -> None:
        self.log_every = log_every
        self.run_dir = run_dir
        self.jsonl = JsonlSink(run_dir / "metrics.jsonl") if cfg.jsonl else None
        self.tensorboard = (
            TensorBoardSink(run_dir / "tensorboard", start_step) if cfg.tensorboard else None
        )
        # The lines of this process, for curves.png when there is no metrics.jsonl to read.
        self.lines: list[dict[str, Any]] = []
        self.wandb = (
            WandbSink(cfg.wandb_project, cfg.wandb_mode, run_dir, name, config)
            if cfg.wandb
            else None
        )
        self.bar = ProgressBar(total_steps, start_step, cfg.progress)
        self.window = Window()
        # The run's first step pays for thread start-up and allocation; leave it out of the
        # run-long throughput unless it is the only step.
        self.run = Window()
        self.first: StepRecord | None = None
        self._last_step: int | None = None

    def _emit(self, line: dict[str, Any]) -> None:
        self.lines.append({k: v for k, v in line.items() if k in ("kind", "step", "loss")
                           or line["kind"] == "eval"})  # fmt: skip
        if self.jsonl is not None:
            self.jsonl.write(line)
        prefix = f"{line['kind']}/"
        if self.wandb is not None:
            self.wandb.log({prefix + k: v for k, v in line.items()}, step=line["step"])
        if self.tensorboard is not None:
            figures = {prefix + k: v for k, v in line.items() if k not in ("kind", "step")}
            self.tensorboard.log(figures, step=line["step"])

    def train_step(self, record: StepRecord) -> dict[str, Any] | None:
        """Account one optimizer step; on a logging step, write and return its line."""
        self.window.add(record)
        self._last_step = record.step
        if self.first is None:
            self.first = record
        else:
            self.run.add(record)
        self.bar.advance(1, loss=f"{record.loss:.4f}")
        if record.step % self.log_every:
            return None
        line = {"kind": "train", "step": record.step, **self.window.figures()}
        self.window = Window()
        self._emit(line)
        return line

    def flush(self) -> dict[str, Any] | None:
        """Write the partial window left at the end of training as one more line."""
        if not len(self.window) or self._last_step is None:
            return None
        line = {"kind": "train", "step": self._last_step, **self.window.figures()}
        self.window = Window()
        self._emit(line)
        return line

    def evaluation(self, step: int, figures: dict[str, float]) -> None:
        """Write an evaluation line and say it on the console / train.log."""
        self._emit({"kind": "eval", "step": step, **figures})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in figures.items())
        log.info("step %d eval: %s", step, shown)

    def run_figures(self) -> dict[str, Any]:
        """Figures over the whole run (first step excluded when there are others)."""
        if len(self.run):
            return self.run.figures()
        if self.first is None:
            return {}
        only = Window()
        only.add(self.first)
        return only.figures()

    def close(self, summary: dict[str, Any]) -> None:
        """Close the sinks and draw ``curves.png`` (a failed drawing is a warning, no more)."""
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.close(summary)
        if self.tensorboard is not None:
            self.tensorboard.close()
        # metrics.jsonl holds the steps before a resume too; the lines only this process's.
        records = read_jsonl(self.jsonl.path) if self.jsonl is not None else self.lines
        try:
            drawn = plot_curves(records, self.run_dir / "curves.png")
        except Exception as err:  # noqa: BLE001 - a picture must never fail a finished run
            log.warning("curves.png not drawn: %s: %s", type(err).__name__, err)
            return
        if drawn is not None:
            log.info("loss and evaluation curves: %s", drawn)
