"""The curve pictures: ``curves.png``, the training loss and the evaluation figures against the
step, drawn when a run closes (beside the timelines); matplotlib is imported only to draw.

Example::

    plot_curves(read_jsonl(run_dir / "metrics.jsonl"), run_dir / "curves.png")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (the sweep table's picture uses it too)."""
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
    plt = pyplot()
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
