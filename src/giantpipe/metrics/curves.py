"""The curve pictures: ``curves.png``, the training loss and the evaluation figures against the
step (one panel per scale), drawn when a run closes; matplotlib is imported only to draw.

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
    """``path`` (PNG): the curves :func:`draw_curves` draws; None when there is nothing to draw.

    Example::

        plot_curves(read_jsonl(run_dir / "metrics.jsonl"), run_dir / "curves.png")
    """
    fig = draw_curves(records)
    if fig is None:
        return None
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def draw_curves(records: list[dict[str, Any]]) -> Any:
    """The figure of metrics.jsonl's records: training and evaluation loss against the optimizer
    step on the first panel, then one panel per scale among the other evaluation figures: the
    fractions (accuracy, top5: 0 to 1) together, every other figure (perplexity, BLEU) alone,
    so that none is flattened by another's range. None when there is nothing to draw.

    Example::

        fig = draw_curves(read_jsonl(run_dir / "metrics.jsonl"))
        [ax.get_title() for ax in fig.axes]      # ['loss', 'accuracy', 'perplexity']
    """
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and "loss" in r]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train and not evals:
        return None
    panels = scale_panels(evals)
    plt = pyplot()
    count = 1 + len(panels)
    fig, axes = plt.subplots(1, count, figsize=(5.5 * count, 4), squeeze=False)
    loss_ax = axes[0][0]
    if train:
        loss_ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if any("loss" in r for r in evals):
        points = [(r["step"], r["loss"]) for r in evals if "loss" in r]
        loss_ax.plot(*zip(*points), "o-", label="eval loss", color="tab:red")
    loss_ax.set(xlabel="optimizer step", ylabel="loss", title="loss")
    loss_ax.legend()
    for ax, names in zip(axes[0][1:], panels):
        for name in names:
            points = [(r["step"], r[name]) for r in evals if _number(r.get(name))]
            ax.plot(*zip(*points), "o-", label=f"eval {name}")
        ax.set(xlabel="optimizer step", ylabel=", ".join(names), title=", ".join(names))
        ax.legend()
    fig.tight_layout()
    return fig


def scale_panels(evals: list[dict[str, Any]]) -> list[list[str]]:
    """The evaluation figures besides the loss, grouped by scale: those always between 0 and 1
    share a panel, each other one has its own.

    >>> scale_panels([{"step": 5, "loss": 4.6, "accuracy": 0.3, "top5": 0.6, "perplexity": 99.0}])
    [['accuracy', 'top5'], ['perplexity']]
    """
    names = sorted(
        {k for r in evals for k, v in r.items() if k not in ("kind", "step", "loss") and _number(v)}
    )
    values = {n: [r[n] for r in evals if _number(r.get(n))] for n in names}
    fractions = [n for n in names if all(0.0 <= v <= 1.0 for v in values[n])]
    return ([fractions] if fractions else []) + [[n] for n in names if n not in fractions]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
