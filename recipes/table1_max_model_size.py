# Command:  python recipes/table1_max_model_size.py           (paper's settings, then our search)
#           python recipes/table1_max_model_size.py --skip-search   (paper's settings only, ~5 min)
#           python recipes/table1_max_model_size.py --quick   (small spaces, for the tests)
# Hardware: any CPU, no GPU: models are sized under fake tensors, never allocated. With CUDA
#           available, each stage is instead materialized and measured on the GPU.
# Reproduces: GPipe Table 1, the largest trainable model. AmoebaNet-D in 8 GB per device
#           (224px, batch 128): Naive-1 (18,208) 82M ... Pipeline-8 (72,512) 1.8B.
#           Transformer-L in 16 GB per device (1024 tokens, batch 32): Naive-1 3 layers
#           282.2M ... Pipeline-8 103 layers 5.3B ... Pipeline-128 1663 layers 83.9B.
"""Table 1 of GPipe: the largest model that trains in a fixed memory per device.

First, **the paper's settings**: each column's own model (AmoebaNet-D (18,208) ... (72,512);
Transformer-L 3 ... 1663 layers), the paper's batch (128 images at 224 px; 32 x 1024 tokens),
RMSProp (12 bytes a parameter), a fixed M and re-materialization (``--chunks``,
``--recompute``; Naive-1: one device, M = 1, none) and a reserve of each device's memory for
what fake tensors do not see (``--reserve``). Per column: whether the paper's model fits, its
peak per device, and the largest model of the same family and width under the same settings.

Second, **our own search**: the largest model giantpipe can train here, M and
re-materialization searched. Each column is a setting (K partitions, M micro-batches,
re-materialization). A search over model sizes uses per-layer memory costs measured under fake
tensors; the chosen model is then built on the meta device and every stage runs one real
training step with the engine (forward, backward with recomputation, RMSProp step) under fake
tensors, where a dispatch-mode tracker counts the live bytes (see ``giantpipe.perf.sizing``; the
model families are in ``recipes/model_sizes.py``). Writes ``results/table1/table1.md`` (the
paper's settings; the search too unless ``--skip-search``), ``results/table1/search.md`` (the
search) and ``results/table1/table1.png``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.testing.outputs import add_output_options, output_path  # noqa: E402

# Fake tensors count what autograd and the optimizer allocate, not the CUDA context, cuDNN
# workspaces or the caching allocator's rounding and fragmentation: on the paper's AmoebaNet-D
# models our fake-tensor sizes came out at 0.88-0.96 of torchgpipe's measured GPU memory
# (issue 25), so up to 12% of a device is spent on what this count does not see. The planner
# keeps the same share (giantpipe.perf.planner.DeviceSpec.reserve = 0.1).
RESERVE = 0.10
RESERVE_SOURCE = (
    "fake-tensor sizes of the paper's AmoebaNet-D models are 0.88-0.96 of torchgpipe's "
    "measured GPU memory (issue 25); the planner's DeviceSpec.reserve is 0.1 too"
)
# The paper does not state M for Table 1; one M for every pipeline column, stated.
CHUNKS = {"amoebanet": 32, "transformer": 32}


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small search space (seconds)")
    add_output_options(parser, "table1")
    parser.add_argument("--optimizer", default="rmsprop", choices=["rmsprop", "sgd", "adam"])
    parser.add_argument("--amoebanet-gib", type=float, default=8.0)
    parser.add_argument("--transformer-gib", type=float, default=16.0)
    parser.add_argument("--only", choices=["amoebanet", "transformer"])
    parser.add_argument("--chunks", type=int, help="M of the paper's pipeline columns "
                        f"(default {CHUNKS})")  # fmt: skip
    parser.add_argument("--recompute", default="always", choices=["always", "except_last"],
                        help="re-materialization of the paper's pipeline columns")  # fmt: skip
    parser.add_argument("--reserve", type=float, default=RESERVE,
                        help=f"share of each device kept back (default {RESERVE}: "
                             f"{RESERVE_SOURCE})")  # fmt: skip
    parser.add_argument("--skip-search", action="store_true",
                        help="only the paper's settings, not our own search")  # fmt: skip
    parser.add_argument("--no-measure", action="store_true",
                        help="paper's columns: predicted peaks only, no engine step")  # fmt: skip
    parser.add_argument("--replicas", type=int, default=4,
                        help="R of the K x R column, full sharding (1: none)")  # fmt: skip
    args = parser.parse_args(argv)
    args.out = output_path(args, ROOT, "table1")
    return args


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch

from giantpipe.perf.replica_state import ReplicaSharding  # noqa: E402
from giantpipe.perf.sizing import (  # noqa: E402
    MeasuredSize,
    ModelFamily,
    ModelSize,
    Setting,
    confirm,
    deepest,
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
        return [Setting.uncut(label, 1, chunks=1, recompute="never")]
    return [Setting.uncut(label, partitions, chunks=m, recompute=c)
            for m in chunks for c in ("except_last", "always")]  # fmt: skip


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
    unit = PAPER_UNIT[family.name][0]
    row(f"parameter memory ({unit}, all devices), paper", [f"{paper[c.label][2]}" for c in columns])
    row("peak activation memory (GiB, all devices), ours",
        [f"{sum(s.activations for s in st) / GIB:.2f}" for st in stages])  # fmt: skip
    row(f"peak activation memory ({unit}, all devices), paper",
        [f"{paper[c.label][3]}" for c in columns])  # fmt: skip
    row(f"peak per device (GiB, budget {budget / GIB:.0f}), ours",
        [f"{c.result.peak / GIB:.2f}" for c in columns])  # fmt: skip
    if check_paper:
        row("paper's model here: predicted peak per device (GiB)",
            [paper_check(family, c, paper[c.label][0], opt) for c in columns])  # fmt: skip
    row("M, re-materialization, micro-batch",
        [f"{p.spec.chunks}, {p.spec.recompute}, {micro_batch(family, p.setting)}"
         for p in sizes])  # fmt: skip
    row("balance", [_fmt_balance(p) for p in sizes])
    row("M measured as", [c.result.stages[0].chunks_measured for c in columns])
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


# ---- the paper's settings ------------------------------------------------------------------

DEPTHS = {"amoebanet": range(6, 1201, 6), "transformer": range(1, 4001)}
DEPTH_FROM = {"AmoebaNet-D": "(6, D)", "Transformer-L": "1 layer"}


@dataclass
class PaperColumn:
    """One column of Table 1 at the paper's settings: the paper's model, sized here."""

    label: str
    size: ModelSize  # the paper's model in this column's setting (predicted peaks)
    usable: int  # bytes a device may hold: budget x (1 - reserve)
    measured: MeasuredSize | None = None  # one training step of every stage, if run
    largest: ModelSize | None = None  # the largest of the same width that fits

    @property
    def peak(self) -> int:
        """Peak per device: measured if it was, else predicted."""
        return self.measured.peak if self.measured else max(self.size.predicted)

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable


def paper_setting(label: str, chunks: int, recompute: str) -> Setting:
    """Naive-1: one device, one micro-batch, no re-materialization; else K, M and the mode."""
    if label.startswith("Naive"):
        return Setting.uncut(label, 1, chunks=1, recompute="never")
    return Setting.uncut(label, int(label.split("-")[1]), chunks=chunks, recompute=recompute)


def paper_size(family: ModelFamily, paper_size: str) -> tuple[int, int]:
    """(L, D) of the paper's size: ``(18,208)`` or a layer count (width 2048)."""
    numbers = [int(x) for x in paper_size.strip("()").split(",")]
    return (numbers[0], numbers[1]) if len(numbers) == 2 else (numbers[0], 2048)


def paper_columns(
    family: ModelFamily,
    paper: dict,
    budget: int,
    chunks: int,
    recompute: str,
    reserve: float,
    depths: Sequence[int],
    opt: str,
    measure: bool,
    labels: Sequence[str] | None = None,
) -> list[PaperColumn]:
    """The paper's model of every column (or of ``labels``) under the paper's settings."""
    usable = int(budget * (1 - reserve))
    columns = []
    for label in labels or list(paper):
        started = time.perf_counter()
        setting = paper_setting(label, chunks, recompute)
        layers, width = paper_size(family, paper[label][0])
        size = size_model(family, setting, layers, width, opt)
        stages = setting.spec.num_stages
        assert size is not None, f"{label}: {layers} layers cannot be cut {stages} ways"
        column = PaperColumn(label, size, usable)
        if measure:
            column.measured = MeasuredSize(size, measure_size(family, size, opt))
        column.largest = deepest(family, setting, width, depths, usable, opt)
        print(f"{family.name} {label} at the paper's settings: {_fmt_params(size.params)}, peak "
              f"{column.peak / GIB:.2f} GiB of {usable / GIB:.2f} "
              f"({time.perf_counter() - started:.0f}s)", flush=True)  # fmt: skip
        columns.append(column)
    return columns


def paper_table(
    family: ModelFamily,
    columns: list[PaperColumn],
    paper: dict,
    budget: int,
    chunks: int,
    recompute: str,
    reserve: float,
    opt: str,
) -> str:
    """Markdown: the paper's models at the paper's settings, beside the paper's numbers."""
    rows = ["| | " + " | ".join(c.label for c in columns) + " |",
            "|---" * (len(columns) + 1) + "|"]  # fmt: skip

    def row(name: str, cells: list[str]) -> None:
        rows.append(f"| {name} | " + " | ".join(cells) + " |")

    row("model (the paper's)", [paper[c.label][0] for c in columns])
    row("parameters, paper", [_fmt_params(paper[c.label][1]) for c in columns])
    row("parameters, built here", [_fmt_params(c.size.params) for c in columns])
    row("K, M, re-materialization, micro-batch",
        [f"{c.size.spec.num_stages}, {c.size.spec.chunks}, {c.size.spec.recompute}, "
         f"{micro_batch(family, c.size.setting)}" for c in columns])  # fmt: skip
    row("balance (memory-greedy)", [_fmt_balance(c.size) for c in columns])
    unit = PAPER_UNIT[family.name][0]
    row(f"parameter memory ({unit}, all devices), paper", [f"{paper[c.label][2]}" for c in columns])
    row("parameter memory (GiB, all devices), 12 B x parameters",
        [f"{12 * c.size.params / GIB:.2f}" for c in columns])  # fmt: skip
    row(f"peak activation memory ({unit}, all devices), paper",
        [f"{paper[c.label][3]}" for c in columns])  # fmt: skip
    row("peak activation memory (GiB, all devices) [derived: peaks - 12 B x parameters]",
        [f"{(sum(c.size.predicted) - 12 * c.size.params) / GIB:.2f}" for c in columns])  # fmt: skip
    how = "measured" if any(c.measured for c in columns) else "predicted"
    row(f"**peak per device (GiB), {how}**", [f"{c.peak / GIB:.2f}" for c in columns])
    row(f"usable per device (GiB): {budget / GIB:.0f} - {reserve:.0%} reserve",
        [f"{c.usable / GIB:.2f}" for c in columns])  # fmt: skip
    row("**fits**", ["yes" if c.fits else "**no**" for c in columns])
    row("**largest of the same width, same settings**",
        [(f"{family.describe(c.largest.layers, c.largest.width)} "
          f"{_fmt_params(c.largest.params)}") if c.largest else "none fits"
         for c in columns])  # fmt: skip
    notes = [paper_note(c, paper_activations_gib(family.name, c.label, paper),
                        NAIVE_GAP.get(family.name, "") if c.label.startswith("Naive") else "")
             for c in columns if not c.fits]  # fmt: skip
    notes += [f"The paper prints {family.name}'s {label} memory cells swapped "
              f"({paper[label][1] / 1e6:.1f}M parameters x 12 B = "
              f"{12 * paper[label][1] / GIB:.2f} GiB is printed as its activations)"
              for name, label in PAPER_SWAPPED if name == family.name]  # fmt: skip
    title = (f"### {family.name}: the paper's models at the paper's settings, "
             f"{budget / GIB:.0f} GiB per device")  # fmt: skip
    settings = (
        f"Batch {family.batch}, {opt} (12 bytes a parameter: weight, gradient, one slot), "
        f"M = {chunks} and re-materialization `{recompute}` in every pipeline column (the paper "
        f"does not state M for Table 1; `--chunks`, `--recompute`), Naive-1 on one device "
        f"without either; {reserve:.0%} of each device reserved (`--reserve`: {RESERVE_SOURCE}). "
        "Peaks are predicted from per-layer profiles under fake tensors"
        + (
            "; measured ones ran every stage's training step with the engine."
            if how == "measured"
            else "."
        )  # fmt: skip
        + " The largest model is the deepest that fits at the column's width, predicted "
        f"(depths from {DEPTH_FROM[family.name]}: 'none fits' means not even that one)."
    )
    return "\n".join([title, "", settings, "", *rows, "", *[f"- {n}" for n in notes]]) + "\n"


def replica_table(
    family: ModelFamily,
    columns: list[PaperColumn],
    usable: int,
    depths: Sequence[int],
    opt: str,
    replicas: int,
) -> str:
    """Markdown: per pipeline column, the largest model of the paper's width on its K devices
    and on K x R devices, each stage spread over R replicas with ``full`` sharding (FSDP2,
    ``pipeline.replica_sharding=full``); both predicted (``perf/replica_state.py``)."""
    rows = ["| column | K devices | K x R devices, full | parameters, x |", "|---|---|---|---|"]
    for column in columns:
        if column.label.startswith("Naive"):
            continue
        spec, width = column.size.spec, column.size.width
        spread = Setting.uncut(column.label, spec.num_stages, ReplicaSharding(replicas, "full"),
                               chunks=spec.chunks, recompute=spec.recompute)  # fmt: skip
        alone, wide = column.largest, deepest(family, spread, width, depths, usable, opt)
        cells = [(f"{family.describe(m.layers, m.width)} {_fmt_params(m.params)}" if m
                  else "none fits") for m in (alone, wide)]  # fmt: skip
        gain = f"{wide.params / alone.params:.2f}" if alone and wide else "-"
        k = spec.num_stages
        rows.append(f"| {column.label} ({k} x {replicas} = {k * replicas}) | {cells[0]} | "
                    f"{cells[1]} | {gain} |")  # fmt: skip
    title = f"### {family.name}: K x R = {replicas} replicas of each stage, full sharding"
    about = (
        f"The largest model of each column's width (its M, re-materialization and {opt}), "
        f"predicted: on K devices as above, and on K x {replicas} devices with each stage's "
        "parameters, gradients and optimizer state spread over its replicas (FSDP2 ZeRO-3, one "
        "unit gathered at a time; its gradients accumulate whole over the micro-batches: "
        "src/giantpipe/perf/replica_state.py, measured in results/replicas/memory.md)."
    )
    return "\n".join([title, "", about, "", *rows]) + "\n"


# The paper's memory cells in GiB: AmoebaNet-D's are decimal GB (318M parameters x 12 B =
# 3.82e9 B, printed 3.8GB), Transformer-L's are GiB (282.2M x 12 B = 3.15 GiB, printed 3.15G).
PAPER_UNIT = {"AmoebaNet-D": ("GB", 1e9 / GIB), "Transformer-L": ("GiB", 1.0)}
# Cells the paper prints in each other's place: Transformer-L Naive-1's "parameter memory" 11.7G
# and "activation memory" 3.15G (its 282.2M parameters take 3.15 GiB at 12 B).
PAPER_SWAPPED = {("Transformer-L", "Naive-1")}
# Why Naive-1 is over budget here and not in the paper: evidence, not a guess
# (benchmarks/naive1_activations.py writes results/table1/naive1_activations.md).
NAIVE_GAP = {
    "AmoebaNet-D": (
        "not a counting error: autograd's graph of (18,208) at batch 128 keeps 38.92 GiB against "
        "the sizing's 38.77, a hand count of a normal cell from the genotype (29 maps of C "
        "channels a sample) gives the sizing's 2.255 GiB, and "
        "torchgpipe's own PyTorch run of this column ran out of memory on a 24 GB P40. Eager "
        "PyTorch keeps every ReLU output (43% of it) and int64 max-pool indices (14%); one "
        "bfloat16 tensor per convolution output, what a compiler that fuses BatchNorm and ReLU "
        "into the convolutions and recomputes them in the backward keeps (as XLA can on TPU), is "
        "5.52 GiB, 0.95x the paper's (results/table1/naive1_activations.md)"
    ),
}


def paper_activations_gib(family: str, label: str, paper: dict) -> float:
    """The paper's peak activation memory of a column in GiB (its units, its swapped cells).

    >>> round(paper_activations_gib("AmoebaNet-D", "Naive-1", PAPER_AMOEBANET), 2)  # 6.26 GB
    5.83
    >>> paper_activations_gib("Transformer-L", "Naive-1", PAPER_TRANSFORMER)  # printed 11.7G
    11.7
    """
    _, _, parameter_memory, activations = paper[label]
    printed = parameter_memory if (family, label) in PAPER_SWAPPED else activations
    return printed * PAPER_UNIT[family][1]


def paper_note(column: PaperColumn, paper_activations: float, why: str = "") -> str:
    """Why a paper's model does not fit here: by how much, and its activations against the
    paper's (``paper_activations``, GiB, all devices: :func:`paper_activations_gib`), in
    float32 here and as they would be in bfloat16; ``why`` adds the evidence."""
    activations = (sum(column.size.predicted) - 12 * column.size.params) / GIB
    spec = column.size.spec
    return (
        f"{column.label} does not fit: {column.peak / GIB:.2f} GiB per device, "
        f"{column.peak / column.usable:.1f}x the usable {column.usable / GIB:.2f} GiB; its "
        f"activations here, {activations:.2f} GiB (float32, M={spec.chunks}, {spec.recompute}), "
        f"are {activations / paper_activations:.1f}x the paper's {paper_activations:.2f} GiB; "
        f"half of them (bfloat16 activations, the TPU's format; the paper does not state its "
        f"precision) would be {activations / 2 / paper_activations:.2f}x"
        + (f". Why: {why}" if why else "")
    )


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


@dataclass
class Results:
    """Both parts of the table, per family name."""

    paper: dict[str, list[PaperColumn]]
    search: dict[str, list[Column]]


def run(args: argparse.Namespace) -> Results:
    """Fills every column, writes table1.md (and search.md, table1.png) under ``args.out``.

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
    command += " --skip-search" if args.skip_search else ""
    markdown = [
        "# GPipe Table 1: largest trainable model",
        "",
        f"Command: `{command}`, {datetime.datetime.now():%Y-%m-%d %H:%M}, torch "
        f"{torch.__version__}, load average {os.getloadavg()[0]:.1f} at start; {how}.",
        "",
        "## 1. The paper's settings",
        "",
    ]
    results = Results({}, {})
    for key, (family, paper, budget) in jobs.items():
        if args.only and key != args.only:
            continue
        if args.quick and key == "amoebanet":  # a 224 px template profile per width: minutes
            markdown.append(f"### {family.name}: the paper's columns are not run with --quick\n")
            continue
        chunks = args.chunks or CHUNKS[key]
        # --quick: three columns, depths up to 400, predicted peaks only (seconds, not minutes)
        labels = list(paper)[:3] if args.quick else None
        depths = range(1, 401) if args.quick else DEPTHS[key]
        measure = not (args.quick or args.no_measure)
        columns = paper_columns(family, paper, budget, chunks, args.recompute, args.reserve,
                                depths, args.optimizer, measure, labels)  # fmt: skip
        markdown.append(paper_table(family, columns, paper, budget, chunks, args.recompute,
                                    args.reserve, args.optimizer))  # fmt: skip
        if args.replicas > 1:
            usable = int(budget * (1 - args.reserve))
            markdown.append(replica_table(family, columns, usable, depths, args.optimizer,
                                          args.replicas))  # fmt: skip
        results.paper[family.name] = columns
    search_md = [
        "## 2. Our own search: the largest model giantpipe can train here",
        "",
        f"M and re-materialization searched, no reserve (the whole budget). The 'ours' rows are "
        f"{how}: every stage of the chosen model ran one training step (forward, backward with "
        f"re-materialization, {args.optimizer} step) with giantpipe's engine.",
        "",
    ]
    plotted: dict[str, tuple[list[Column], dict]] = {}
    if not args.skip_search:
        for key, (family, paper, budget) in jobs.items():
            if args.only and key != args.only:
                continue
            found = run_family(family, space[key], budget, args.optimizer)
            search_md.append(table(family, found, paper, budget, args.optimizer, how,
                                   not args.quick))  # fmt: skip
            plotted[family.name] = (found, paper)
            results.search[family.name] = found
    else:
        search_md.append("Not run in this invocation (`--skip-search`); see search.md.\n")
    markdown += search_md
    markdown.append(f"Sizing and measurement took {time.perf_counter() - started:.0f} s.\n")
    text = "\n".join(markdown)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table1.md").write_text(text)
    if not args.skip_search:
        (args.out / "search.md").write_text(f"Command: `{command}`\n\n" + "\n".join(search_md))
        plot(plotted, args.out / "table1.png", how)
    else:
        plot_paper(results.paper, jobs, args.out / "table1.png")
    return results


def plot_paper(
    columns: dict[str, list[PaperColumn]],
    jobs: dict[str, tuple[ModelFamily, dict, int]],
    path: Path,
) -> None:
    """Parameters per column at the paper's settings: the paper's model and the largest of its
    width that fits here (log scale), one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(columns)), figsize=(6 * max(1, len(columns)), 4.2),
                             squeeze=False)  # fmt: skip
    for ax, (name, cols) in zip(axes[0], columns.items()):
        x = range(len(cols))
        ax.bar([i - 0.2 for i in x], [c.size.params for c in cols], width=0.4,
               label="the paper's model", color="#bbbbbb")  # fmt: skip
        ax.bar(
            [i + 0.2 for i in x],
            [c.largest.params if c.largest else 0 for c in cols],
            width=0.4,
            label="largest that fits here, same settings",
            color="#1f77b4",
        )
        for i, c in enumerate(cols):
            ax.text(i - 0.2, c.size.params, "fits" if c.fits else "no", ha="center",
                    va="bottom", fontsize=8)  # fmt: skip
        ax.set_yscale("log")
        ax.set_xticks(list(x), [c.label for c in cols], rotation=20)
        ax.set_ylabel("parameters")
        ax.set_title(f"{name} at the paper's settings")
        ax.legend(fontsize=7)
    fig.suptitle("GPipe Table 1 at the paper's settings (sized under fake tensors)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
