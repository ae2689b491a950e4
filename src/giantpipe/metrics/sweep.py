"""The sweep table: at the end of a multirun, ``sweep.md`` / ``sweep.csv`` (each job's
overrides, status and objective) and ``sweep.png`` (the objective against each swept key).

The Hydra callback that calls :func:`write_sweep_table` lives with the command line; this is
its logic, which needs no Hydra.

Example::

    write_sweep_table(Path("outputs/multirun/2026-12-03/13-05-00"), "eval/loss")
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from giantpipe.metrics.curves import pyplot


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
    """``path`` (PNG): the figure :func:`draw_sweep` draws, if there is a swept key."""
    if not swept:
        return None
    fig = draw_sweep(rows, swept, objective)
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def draw_sweep(rows: list[dict[str, Any]], swept: list[str], objective: str) -> Any:
    """The objective against each swept key, one panel per key (numbers on a numeric axis,
    anything else as categories), its values on the axis as they are (no offset such as
    ``1e-8+1.9411071``) and a range of at least 2% of their size: values equal but for float
    noise are drawn equal.

    Example::

        fig = draw_sweep(sweep_rows(sweep_dir, "eval/loss"), ["pipeline.chunks"], "eval/loss")
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, len(swept), figsize=(4.5 * len(swept), 3.8), squeeze=False)
    for ax, key in zip(axes[0], swept):
        points = [(str(r.get(key, "")), r[objective]) for r in rows]
        try:
            xs: list[Any] = [float(x) for x, _ in points]
        except ValueError:
            xs = [x for x, _ in points]
        ys = [y for _, y in points]
        ax.plot(xs, ys, "o")
        ax.set(xlabel=key, ylabel=objective)
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
        ax.set_ylim(*value_range([y for y in ys if math.isfinite(y)]) or ax.get_ylim())
    fig.suptitle(f"{objective} per job")
    fig.tight_layout()
    return fig


def value_range(values: list[float], least: float = 0.01) -> tuple[float, float] | None:
    """Axis limits around ``values`` spanning at least ``least`` of their size on each side of
    their middle (None: no values, matplotlib chooses).

    >>> [round(limit, 4) for limit in value_range([1.9411071, 1.94110711])]
    [1.9217, 1.9605]
    >>> [round(limit, 4) for limit in value_range([0.5, 2.5])]
    [0.45, 2.55]
    """
    if not values:
        return None
    low, high = min(values), max(values)
    middle, half = (low + high) / 2, (high - low) / 2
    half = max(half * 1.05, least * max(abs(low), abs(high)) or 0.5)
    return middle - half, middle + half
