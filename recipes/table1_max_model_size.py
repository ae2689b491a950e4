# Command:  python recipes/table1_max_model_size.py           (full search, a few minutes)
#           python recipes/table1_max_model_size.py --quick   (small search space, for the tests)
# Hardware: any CPU, no GPU: models are sized under fake tensors, never allocated. With CUDA
#           available, each stage is instead materialized and measured on the GPU.
# Reproduces: GPipe Table 1, the largest trainable model. AmoebaNet-D in 8 GB per device
#           (224px, batch 128): Naive-1 (18,208) 82M ... Pipeline-8 (72,512) 1.8B.
#           Transformer-L in 16 GB per device (1024 tokens, batch 32): Naive-1 3 layers
#           282.2M ... Pipeline-8 103 layers 5.3B ... Pipeline-128 1663 layers 83.9B.
"""Table 1 of GPipe: the largest model that trains in a fixed memory per device.

Each column is a setting (K partitions, M micro-batches, re-materialization). A search over
model sizes uses per-layer memory costs measured under fake tensors; the chosen model is then
built on the meta device and every stage runs one real training step with the engine
(forward, backward with recomputation, RMSProp step) under fake tensors, where a dispatch-mode
tracker counts the live bytes (see ``giantpipe.perf.sizing``; the model families are in
``recipes/model_sizes.py``). Writes
``results/table1/table1.md`` and ``results/table1/table1.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.perf.sizing import (  # noqa: E402
    MeasuredSize,
    ModelFamily,
    ModelSize,
    Setting,
    confirm,
    measure_size,
    micro_batch,
    search,
    size_model,
)
from recipes.model_sizes import AmoebaNetD, TransformerL  # noqa: E402

GIB = 2**30

# The paper's Table 1: label -> (size, parameters, parameter memory GB, activation memory GB);
# memory columns are totals over the K accelerators, as printed in the paper.
PAPER_AMOEBANET = {
    "Naive-1": ("(18,208)", 82e6, 1.05, 6.26),
    "Pipeline-1": ("(18,416)", 318e6, 3.8, 3.46),
    "Pipeline-2": ("(18,544)", 542e6, 6.45, 8.11),
    "Pipeline-4": ("(36,544)", 1.05e9, 12.53, 15.21),
    "Pipeline-8": ("(72,512)", 1.8e9, 24.62, 26.24),
}
PAPER_TRANSFORMER = {
    "Naive-1": ("3", 282.2e6, 11.7, 3.15),
    "Pipeline-1": ("13", 785.8e6, 8.8, 6.4),
    "Pipeline-8": ("103", 5.3e9, 59.5, 50.9),
    "Pipeline-32": ("415", 21.0e9, 235.1, 199.9),
    "Pipeline-128": ("1663", 83.9e9, 937.9, 796.1),
}


@dataclass(frozen=True)
class Space:
    """What one family's search tries."""

    partitions: tuple[int, ...]
    chunks: tuple[int, ...]  # M for the pipeline columns (the naive column has M = 1)
    widths: tuple[int, ...]
    depths: tuple[int, ...]
    refine: int  # width step of the fine search around the best coarse width (0: none)
    step: int  # depth step when a measured candidate is over budget
    naive: bool = True  # include the Naive-1 column


def spaces(quick: bool) -> dict[str, Space]:
    """Search spaces per family; ``quick`` keeps the test run to seconds."""
    if quick:
        return {
            "amoebanet": Space((2,), (32,), (32,), (6, 12), 0, 6, naive=False),
            "transformer": Space((1,), (8,), (2048,), tuple(range(1, 41)), 0, 1),
        }
    coarse = (16, 32, 64, 128, *range(256, 2049, 128))
    return {
        "amoebanet": Space((1, 2, 4, 8), (32, 128), coarse, tuple(range(18, 601, 6)), 16, 6),
        "transformer": Space((1, 8, 32, 128), (8, 32), (2048,), tuple(range(1, 4001)), 0, 1),
    }


@dataclass
class Column:
    """One column of the table: our measured result, or the smallest model, over budget."""

    label: str
    result: MeasuredSize
    fits: bool
    seconds: float


def settings_for(label: str, partitions: int, chunks: Sequence[int]) -> list[Setting]:
    """Naive: no pipeline, one micro-batch, no re-materialization; else every M and mode."""
    if label.startswith("Naive"):
        return [Setting(label, 1, 1, "never")]
    return [Setting(label, partitions, m, c) for m in chunks for c in ("except_last", "always")]


def run_column(
    family: ModelFamily, label: str, settings: list[Setting], space: Space, budget: int, opt: str
) -> Column:
    """Searches, then measures, the largest model of one column."""
    started = time.perf_counter()
    sizes = search(family, settings, budget, space.widths, space.depths, opt, space.refine)
    if sizes:
        result = confirm(family, sizes, budget, opt, step=space.step)
        return Column(label, result, True, time.perf_counter() - started)
    # Nothing fits: measure the smallest model of the space to show by how much.
    smallest = size_model(family, settings[0], space.depths[0], min(space.widths), opt)
    assert smallest is not None, f"{label}: the smallest model cannot be cut"
    result = MeasuredSize(smallest, measure_size(family, smallest, opt))
    return Column(label, result, False, time.perf_counter() - started)


def run_family(
    family: ModelFamily, space: Space, budget: int, opt: str, log: bool = True
) -> list[Column]:
    """The naive column and one pipeline column per K."""
    columns = []
    labels = ["Naive-1"] * space.naive + [f"Pipeline-{k}" for k in space.partitions]
    for label in labels:
        k = int(label.split("-")[1])
        column = run_column(family, label, settings_for(label, k, space.chunks), space, budget, opt)
        columns.append(column)
        if log:
            size = column.result.size
            print(
                f"{family.name} {label}: {family.describe(size.layers, size.width)} "
                f"{size.params / 1e6:.1f}M, peak {column.result.peak / GIB:.2f} GiB/device "
                f"({column.seconds:.0f}s)",
                flush=True,
            )
    return columns


def paper_check(family: ModelFamily, column: Column, paper_size: str, opt: str) -> str:
    """Predicted peak per device of the paper's model in our setting (from layer profiles)."""
    numbers = [int(x) for x in paper_size.strip("()").split(",")]
    layers, width = (numbers[0], numbers[1]) if len(numbers) == 2 else (numbers[0], 2048)
    size = size_model(family, column.result.size.setting, layers, width, opt)
    return "-" if size is None else f"{max(size.predicted) / GIB:.1f}"


def _fmt_params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def table(
    family: ModelFamily,
    columns: list[Column],
    paper: dict,
    budget: int,
    opt: str,
    how: str,
    check_paper: bool = True,
) -> str:
    """Markdown: our measured numbers beside the paper's, one column per setting.

    With ``check_paper``, a row gives the predicted peak of the paper's own model in our
    setting (one more layer profile per width; the quick run skips it).
    """
    head = "| | " + " | ".join(c.label for c in columns) + " |"
    rows = [head, "|---" * (len(columns) + 1) + "|"]

    def row(name: str, cells: list[str]) -> None:
        rows.append(f"| {name} | " + " | ".join(cells) + " |")

    sizes = [c.result.size for c in columns]
    described = [family.describe(p.layers, p.width) + ("" if c.fits else " (does not fit)")
                 for p, c in zip(sizes, columns)]  # fmt: skip
    row("size, ours", described)
    row("size, paper", [paper[c.label][0] for c in columns])
    row("parameters, ours", [_fmt_params(p.params) for p in sizes])
    row("parameters, paper", [_fmt_params(paper[c.label][1]) for c in columns])
    stages = [c.result.stages for c in columns]
    row("parameter memory (GiB, all devices), ours",
        [f"{sum(s.param_memory for s in st) / GIB:.2f}" for st in stages])  # fmt: skip
    row("parameter memory (GB, all devices), paper", [f"{paper[c.label][2]}" for c in columns])
    row("peak activation memory (GiB, all devices), ours",
        [f"{sum(s.activations for s in st) / GIB:.2f}" for st in stages])  # fmt: skip
    row("peak activation memory (GB, all devices), paper",
        [f"{paper[c.label][3]}" for c in columns])  # fmt: skip
    row(f"peak per device (GiB, budget {budget / GIB:.0f}), ours",
        [f"{c.result.peak / GIB:.2f}" for c in columns])  # fmt: skip
    if check_paper:
        row("paper's model here: predicted peak per device (GiB)",
            [paper_check(family, c, paper[c.label][0], opt) for c in columns])  # fmt: skip
    row("M, re-materialization, micro-batch",
        [f"{p.setting.chunks}, {p.setting.recompute}, {micro_batch(family, p.setting)}"
         for p in sizes])  # fmt: skip
    row("balance", [_fmt_balance(p) for p in sizes])
    row("M measured as", [c.result.stages[0].microbatches for c in columns])
    notes = [c.label + " first measured over budget: " + ", ".join(c.result.tried)
             for c in columns if c.result.tried]  # fmt: skip
    title = f"### {family.name}: largest model in {budget / GIB:.0f} GiB per device ({how})"
    return "\n".join([title, "", *rows, "", *[f"- {n}" for n in notes]]).rstrip() + "\n"


def _fmt_balance(size: ModelSize) -> str:
    balance = list(size.balance)
    if len(set(balance)) <= 3 and len(balance) > 8:
        first, last = balance[0], balance[-1]
        return f"[{first}, {balance[1]} x {len(balance) - 2}, {last}]"
    return str(balance)


def measured_how() -> str:
    """What produced the numbers: the GPU's allocator, or fake tensors on this CPU."""
    if torch.cuda.is_available():
        return f"measured with torch.cuda.max_memory_allocated on {torch.cuda.get_device_name()}"
    return "sized under fake tensors (not measured on a GPU)"


def plot(results: dict[str, tuple[list[Column], dict]], path: Path, how: str) -> None:
    """Parameters vs K, ours and the paper's, one panel per family (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, (name, (columns, paper)) in zip(axes[0], results.items()):
        labels = [c.label for c in columns]
        x = range(len(labels))
        ours = [c.result.size.params if c.fits else 0 for c in columns]
        theirs = [paper[c.label][1] for c in columns]
        ax.bar([i - 0.2 for i in x], theirs, width=0.4, label="paper (TPU)", color="#bbbbbb")
        ax.bar([i + 0.2 for i in x], ours, width=0.4, label="giantpipe", color="#1f77b4")
        ax.set_yscale("log")
        for i, column in enumerate(columns):
            if not column.fits:  # even the smallest model is over budget
                ax.text(i + 0.2, min(theirs), "does not fit", rotation=90, ha="center",
                        va="bottom", fontsize=8)  # fmt: skip
        ax.set_xticks(list(x), labels, rotation=20)
        ax.set_ylabel("parameters of the largest model")
        ax.set_title(name)
        ax.legend()
    fig.suptitle(f"GPipe Table 1: largest trainable model ({how})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small search space (seconds)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "table1")
    parser.add_argument("--optimizer", default="rmsprop", choices=["rmsprop", "sgd", "adam"])
    parser.add_argument("--amoebanet-gib", type=float, default=8.0)
    parser.add_argument("--transformer-gib", type=float, default=16.0)
    parser.add_argument("--only", choices=["amoebanet", "transformer"])
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, list[Column]]:
    """Fills every column, writes table1.md and table1.png under ``args.out``.

    Returns the columns per family name (the tests check them against the models).
    """
    how = measured_how()
    space = spaces(args.quick)
    jobs: dict[str, tuple[ModelFamily, dict, int]] = {
        "amoebanet": (AmoebaNetD(), PAPER_AMOEBANET, int(args.amoebanet_gib * GIB)),
        "transformer": (TransformerL(), PAPER_TRANSFORMER, int(args.transformer_gib * GIB)),
    }
    started = time.perf_counter()
    command = "python recipes/table1_max_model_size.py" + (" --quick" if args.quick else "")
    markdown = [
        "# GPipe Table 1: largest trainable model",
        "",
        f"The 'ours' rows are {how}: every stage of the chosen model ran one training step "
        f"(forward, backward with re-materialization, {args.optimizer} step) with giantpipe's "
        f"engine. Command: `{command}`.",
        "",
    ]
    results: dict[str, tuple[list[Column], dict]] = {}
    for key, (family, paper, budget) in jobs.items():
        if args.only and key != args.only:
            continue
        columns = run_family(family, space[key], budget, args.optimizer)
        markdown.append(table(family, columns, paper, budget, args.optimizer, how, not args.quick))
        results[family.name] = (columns, paper)
    markdown.append(f"Search and measurement took {time.perf_counter() - started:.0f} s.\n")
    text = "\n".join(markdown)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table1.md").write_text(text)
    plot(results, args.out / "table1.png", how)
    return {name: columns for name, (columns, _) in results.items()}


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
