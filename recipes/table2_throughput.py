# Command:  python recipes/table2_throughput.py            (full: 20-40 min on 2 shared cores)
#           python recipes/table2_throughput.py --quick    (tiny stand-ins; what the tests run)
# Hardware: any CPU. Measured cells: K=2 CPU stand-in devices (one core each) training small
#           stand-ins of the paper's models, as Hydra multirun jobs (train.py -m sweep=table2).
#           Simulated cells: the engine's simulator fed (a) by per-layer costs of the same
#           stand-ins measured on this CPU, (b) by per-layer FLOPs and bytes of the full-size
#           models on a V100-32GB with NVLink (Table 2) and a P100-16GB on PCIe (Table 3).
# Reproduces: GPipe Table 2, normalized throughput (K=2, M=1 is 1): AmoebaNet-D (18,256)
#           1.21 / 1.84 / 3.48 and Transformer-48 1.8 / 3.4 / 6.3 at M=32 for K = 2 / 4 / 8;
#           Table 3 (PCIe, M=32, K=2 is 1): AmoebaNet-D (18,128) 1 / 1.7 / 2.7, Transformer-24
#           1 / 1.8 / 3.3; torchgpipe's P40 AmoebaNet-D (18,256) 1x ... 4.95x alongside.
"""GPipe Tables 2 and 3: throughput against K partitions and M micro-batches.

Every number in our columns comes from running code, each cell labelled by its column:

- ``measured``: samples/s of a real training run (``summary.json``, first step left out) of a
  CPU stand-in of the model at K=2 on two CPU stand-in devices; one Hydra multirun per model,
  ``python train.py -m sweep=table2 recipe=...`` (``sweep=table2_pcie`` for Table 3).
- ``simulated (CPU profile)``: the same stand-in, each layer profiled alone on one core of this
  machine at each micro-batch size, cut into K stages by measured time, and the GPipe schedule
  simulated (one core per stage, no contention, no executor overhead).
- ``simulated (device)``: the full-size model's per-layer FLOPs and bytes (measured on the meta
  device, :mod:`giantpipe.perf.costs`) on a named device's FLOP-and-byte model
  (:class:`giantpipe.perf.planner.DeviceSpec`); the batch is adjusted to fit memory, as in the
  paper: the planner picks the balance and re-materialization, and we keep the fastest batch that
  fits.

The paper's and torchgpipe's numbers are quoted from docs (shared/reference/gpipe-paper.md).
Writes ``results/table2/table2.md`` and ``results/table2/table2.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.engine.microbatch import scatter  # noqa: E402
from giantpipe.engine.schedule import gpipe  # noqa: E402
from giantpipe.perf.balance import solve_balance  # noqa: E402
from giantpipe.perf.costs import LayerCost, measure_layers  # noqa: E402
from giantpipe.perf.planner import DeviceSpec, plan  # noqa: E402
from giantpipe.perf.simulate import StageCost, simulate  # noqa: E402
from giantpipe.perf.stage_profile import profile_stages  # noqa: E402
from recipes.model_sizes import build as build_full_size  # noqa: E402

GIB = 2**30
Cell = tuple[int, int]  # (K, M)

# Named devices for the FLOP-and-byte model: fp32 peak, memory, link to the neighbour. The
# paper's Table 2 ran on TPUv3 cores; a V100 with NVLink stands in for a fast interconnect.
DEVICES = {
    "V100-32GB, NVLink 50 GB/s": DeviceSpec(
        peak_flops=15.7e12, memory_bytes=32 * GIB, link_bandwidth=50e9
    ),
    "P100-16GB, PCIe 10 GB/s": DeviceSpec(
        peak_flops=9.3e12, memory_bytes=16 * GIB, link_bandwidth=10e9
    ),
}

# Quoted from the paper (Tables 2 and 3) and torchgpipe's benchmarks (8x P40).
PAPER = {
    "amoebanet_t2": {(2, 1): 1, (4, 1): 1.13, (8, 1): 1.38, (2, 4): 1.07, (4, 4): 1.26,
                     (8, 4): 1.72, (2, 32): 1.21, (4, 32): 1.84, (8, 32): 3.48},
    "transformer_t2": {(2, 1): 1, (4, 1): 1.07, (8, 1): 1.3, (2, 4): 1.7, (4, 4): 3.2,
                       (8, 4): 4.8, (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3},
    "amoebanet_t3": {(2, 32): 1, (4, 32): 1.7, (8, 32): 2.7},
    "transformer_t3": {(2, 32): 1, (4, 32): 1.8, (8, 32): 3.3},
}  # fmt: skip
TORCHGPIPE = {  # (K, M) -> (batch, samples/s, speed-up), AmoebaNet-D (18,256) on P40s
    (2, 1): (96, 26.7, 1.0), (2, 4): (256, 41.1, 1.54), (2, 32): (1280, 47.4, 1.77),
    (4, 1): (160, 26.8, 1.0), (4, 4): (360, 44.5, 1.67), (4, 32): (1152, 72.4, 2.71),
    (8, 1): (196, 24.9, 0.93), (8, 4): (480, 70.1, 2.62), (8, 32): (1280, 132.4, 4.95),
}  # fmt: skip


@dataclass(frozen=True)
class Model:
    """One model of one table: the paper's, its CPU stand-in, its simulated device."""

    key: str
    title: str  # the paper's model
    table: int
    recipe: str
    sweep: str
    stand_in: tuple[str, ...]  # Hydra overrides that make the CPU stand-in
    stand_in_title: str
    full_size: tuple[str, int, int]  # model_sizes.build(name, layers, filters)
    device: str  # a key of DEVICES
    ks: tuple[int, ...] = (2, 4, 8)
    ms: tuple[int, ...] = (1, 4, 32)

    @property
    def cells(self) -> list[Cell]:
        return [(k, m) for m in self.ms for k in self.ks]


AMOEBA_CPU = ("data.image_size=64", "data.num_classes=100", "data.batch_size=32")
LM_CPU = ("model.d_model=64", "model.ffn_dim=256", "model.num_heads=4", "data.vocab_size=512",
          "data.seq_len=32", "data.batch_size=32")  # fmt: skip
V100, P100 = list(DEVICES)
MODELS = (
    Model("amoebanet_t2", "AmoebaNet-D (18, 256)", 2, "amoebanet_d_speed", "table2",
          ("model.num_filters=32", *AMOEBA_CPU), "AmoebaNet-D (18, 32), 64 px, batch 32",
          ("amoebanet-d", 18, 256), V100),
    Model("transformer_t2", "Transformer-48", 2, "transformer_lm_scaling", "table2",
          ("model.num_layers=48", *LM_CPU), "Transformer-48, d 64, FFN 256, 32 tokens, batch 32",
          ("transformer-l", 48, 0), V100),
    Model("amoebanet_t3", "AmoebaNet-D (18, 128)", 3, "amoebanet_d_speed", "table2_pcie",
          ("model.num_filters=16", *AMOEBA_CPU), "AmoebaNet-D (18, 16), 64 px, batch 32",
          ("amoebanet-d", 18, 128), P100, ms=(32,)),
    Model("transformer_t3", "Transformer-24", 3, "transformer_lm_scaling", "table2_pcie",
          ("model.num_layers=24", *LM_CPU), "Transformer-24, d 64, FFN 256, 32 tokens, batch 32",
          ("transformer-l", 24, 0), P100, ms=(32,)),
)  # fmt: skip
QUICK_STAND_IN = {  # seconds, not minutes: the structure of the models, tiny sizes
    "amoebanet": ("model.num_layers=6", "model.num_filters=8", "data.image_size=64",
                  "data.num_classes=10", "data.batch_size=8"),
    "transformer": ("model.num_layers=4", "model.d_model=32", "model.ffn_dim=64",
                    "model.num_heads=2", "data.vocab_size=64", "data.seq_len=8",
                    "data.batch_size=8"),
}  # fmt: skip


@dataclass
class Results:
    """Per cell of one model: what was measured and what was simulated."""

    measured: dict[Cell, float] = field(default_factory=dict)  # samples/s
    measured_bubble: dict[Cell, float] = field(default_factory=dict)
    cpu_sim: dict[Cell, float] = field(default_factory=dict)  # samples/s
    device_sim: dict[Cell, tuple[int, float, str]] = field(default_factory=dict)


# ---- measured: a Hydra multirun per model ---------------------------------------------------


def run_sweep(model: Model, steps: int, out: Path, extra: Sequence[str] = ()) -> Path:
    """``train.py -m sweep=...`` at K=2 on CPU stand-ins; returns the sweep directory."""
    sweep_dir = out / "runs" / model.key
    command = [
        sys.executable, str(ROOT / "train.py"), "-m", f"sweep={model.sweep}",
        f"recipe={model.recipe}", *model.stand_in, "pipeline.devices=cpu",
        "pipeline.num_devices=2", f"pipeline.chunks={','.join(map(str, model.ms))}",
        f"trainer.max_steps={steps}", f"trainer.log_every={steps}", "logger.progress=none",
        f"hydra.sweep.dir={sweep_dir}", *extra,
    ]  # fmt: skip
    print("$ OMP_NUM_THREADS=1", " ".join(command[1:]), flush=True)
    # One intra-op thread per process, so each stage gets one (GPipe shares the caller's
    # threads among the stages): on this shared 2-core VM OpenMP with 2 threads runs 30-60x
    # slower under load (threads spin at barriers while the other one is descheduled).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=ROOT, env=env, check=False)  # a failed job: status=failed
    return sweep_dir


def collect(sweep_dir: Path, results: Results) -> None:
    """Reads each job's summary.json into the measured cells (failed jobs are left out)."""
    for path in sorted(sweep_dir.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("status") != "completed":
            print(f"warning: {path.parent} did not complete: {summary.get('error')}")
            continue
        cell = (len(summary["pipeline/devices"]), int(summary["pipeline/chunks"]))
        results.measured[cell] = float(summary["train/samples_per_s"])
        results.measured_bubble[cell] = float(summary.get("pipeline/bubble", float("nan")))


# ---- simulated from a per-layer profile on this CPU ----------------------------------------


def compose(recipe: str, overrides: Sequence[str]) -> Any:
    """The experiment config the runner would build for these overrides (dataclasses)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from giantpipe.cli import register_configs, to_experiment

    register_configs(ROOT / "conf")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return to_experiment(hydra_compose("config", [f"recipe={recipe}", *overrides]))


def stand_in(model: Model) -> tuple[nn.Sequential, Any, Any, Any, str]:
    """The stand-in model, one training batch and the loss, exactly as the measured runs."""
    from giantpipe.runner.build import build_model
    from giantpipe.runner.losses import build_loss
    from giantpipe.runner.registry import build_from_target

    cfg = compose(model.recipe, model.stand_in)
    torch.manual_seed(cfg.trainer.seed)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = build_from_target(cfg.data, "data", run_dir=Path(tmp))
    net = build_model(cfg).train()
    inputs, targets = next(bundle.train_batches(cfg.trainer.seed, 0))
    summed = bundle.loss_normalizer is not None
    loss = build_loss(bundle.loss, cfg.trainer.label_smoothing, bundle.ignore_index, summed)
    return net, inputs, targets, loss, cfg.pipeline.recompute


def profile_layers(net: nn.Sequential, x: Any, y: Any, loss: Any, repeats: int) -> list[StageCost]:
    """Each layer alone on one core, on micro-batch ``x`` (the loss on the last layer)."""
    layers = [nn.Sequential(layer) for layer in net]
    return profile_stages(layers, [torch.device("cpu")] * len(layers), x, y, loss, 1.0,
                          repeats=repeats, threads=1)  # fmt: skip


def merge(layers: Sequence[StageCost]) -> StageCost:
    """A stage of consecutive layers: times add up; it keeps its input and every inner input."""
    total = {f: sum(getattr(c, f) for c in layers) for f in
             ("forward", "backward", "backward_input", "weight", "forward_no_grad", "recompute",
              "activation_bytes", "static_bytes")}  # fmt: skip
    total["activation_bytes"] += sum(c.input_bytes for c in layers[1:])
    return StageCost(**total, send=layers[-1].send, input_bytes=layers[0].input_bytes)


def simulate_profile(layers: Sequence[StageCost], k: int, m: int, checkpoint: str) -> float:
    """Seconds per step of GPipe(K, M) on stages cut by measured time from ``layers``."""
    balance = solve_balance([c.forward + c.backward for c in layers], k)
    bounds = [sum(balance[:i]) for i in range(k + 1)]
    stages = [merge(layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    return simulate(gpipe(k, m), stages, checkpoint).step_time


def cpu_simulation(model: Model, repeats: int, results: Results) -> None:
    net, inputs, targets, loss, checkpoint = stand_in(model)
    total = int(targets.shape[0])
    torch.set_num_threads(1)
    for m in model.ms:
        x, y = scatter(inputs, m)[0], scatter(targets, m)[0]
        layers = profile_layers(net, x, y, loss, repeats)
        for k in model.ks:
            results.cpu_sim[(k, m)] = total / simulate_profile(layers, k, m, checkpoint)


# ---- simulated on a named device, full-size model -------------------------------------------


def fit_batch(
    layers: Sequence[LayerCost], k: int, m: int, device: DeviceSpec, max_batch: int
) -> tuple[int, float, str] | None:
    """The fastest (batch, samples/s, checkpoint) of GPipe(K, M) that fits in memory, over
    batches m * 2^j: the paper adjusted the batch "to fit memory"."""
    best = None
    batch = m
    while batch <= max_batch:
        found = plan(layers, k, batch, device, schedules=("gpipe",), chunks=(m,),
                     recompute=("always", "except_last"))  # fmt: skip
        if not found:
            break  # larger batches need more memory still
        if best is None or found[0].samples_per_s > best[1]:
            best = (batch, found[0].samples_per_s, found[0].recompute)
        batch *= 2
    return best


def device_simulation(model: Model, max_batch: int, results: Results) -> None:
    name, layers, filters = model.full_size
    net, sample = build_full_size(name, layers, filters or 256)
    costs = measure_layers(net, sample, loss_saves_output=True)
    for cell in model.cells:
        fit = fit_batch(costs, *cell, DEVICES[model.device], max_batch)
        if fit is not None:
            results.device_sim[cell] = fit


# ---- the table and the plot -----------------------------------------------------------------


def normalized(values: dict[Cell, float], base: Cell) -> dict[Cell, float]:
    return {c: v / values[base] for c, v in values.items()} if base in values else {}


def ideal(cell: Cell, base: Cell) -> float:
    """[derived] the pure bubble model K*M/(M+K-1), normalized to the base cell."""

    def rate(k: int, m: int) -> float:
        return k * m / (m + k - 1)

    return rate(*cell) / rate(*base)


def model_table(model: Model, r: Results) -> str:
    base = (model.ks[0], model.ms[0])
    meas, cpu = normalized(r.measured, base), normalized(r.cpu_sim, base)
    dev = normalized({c: v[1] for c, v in r.device_sim.items()}, base)
    tg = model.key == "amoebanet_t2"
    head = ["K", "M", "paper", *(["torchgpipe P40: batch, samples/s (x)"] if tg else []),
            "ideal K·M/(M+K-1) [derived]", "**measured** CPU: samples/s (x)",
            "**simulated** CPU profile: samples/s (x)",
            f"**simulated** {model.device}: batch, ckpt, samples/s (x)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for cell in model.cells:
        paper = PAPER[model.key].get(cell)
        row = [str(cell[0]), str(cell[1]), "-" if paper is None else f"{paper:g}"]
        if tg:
            b, s, x = TORCHGPIPE.get(cell, ("-", "-", float("nan")))
            row.append(f"{b}, {s}, ({x:.2f})")
        row.append(f"{ideal(cell, base):.2f}")
        row.append(f"{r.measured[cell]:.2f} ({meas[cell]:.2f})" if cell in meas else "not run")
        row.append(f"{r.cpu_sim[cell]:.2f} ({cpu[cell]:.2f})" if cell in cpu else "-")
        if cell in dev:
            b, s, ck = r.device_sim[cell]
            row.append(f"{b}, {ck}, {s:.1f} ({dev[cell]:.2f})")
        else:
            row.append("does not fit")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def report(models: Sequence[Model], results: dict[str, Results], header: str) -> str:
    parts = [header]
    for table in (2, 3):
        for model in (m for m in models if m.table == table):
            base = f"K={model.ks[0]}, M={model.ms[0]}"
            parts += [
                f"## Table {table}: {model.title} (normalized to {base})",
                "",
                f"CPU stand-in: {model.stand_in_title} (`recipe={model.recipe}` "
                f"`{' '.join(model.stand_in)}`); full size simulated on {model.device}.",
                "",
                model_table(model, results[model.key]),
                "",
            ]
    return "\n".join(parts)


def plot(models: Sequence[Model], results: dict[str, Results], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        r, base = results[model.key], (model.ks[0], model.ms[0])
        sources = [("paper", PAPER[model.key], "--", "o"),
                   ("sim. device", normalized({c: v[1] for c, v in r.device_sim.items()}, base),
                    "-", "s"),
                   ("sim. CPU profile", normalized(r.cpu_sim, base), ":", "^"),
                   ("measured CPU", normalized(r.measured, base), "", "*")]  # fmt: skip
        for i, m in enumerate(model.ms):
            for label, values, style, marker in sources:
                ks = [k for k in model.ks if (k, m) in values]
                ax.plot(ks, [values[(k, m)] for k in ks], linestyle=style, marker=marker,
                        color=f"C{i}", markersize=10 if marker == "*" else 5,
                        label=f"{label}, M={m}")  # fmt: skip
        ax.set(title=f"Table {model.table}: {model.title}", xlabel="K (partitions)",
               ylabel="normalized throughput", xticks=list(model.ks))  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------


def quick_models() -> tuple[Model, ...]:
    """Tiny stand-ins, M in (1, 4) (Table 3: M=4) and K in (2, 4): the same code path, for one
    model of each family and each table (each sweep costs a start-up of train.py)."""
    out = []
    for model in (m for m in MODELS if m.key in ("amoebanet_t2", "transformer_t3")):
        family = model.key.split("_")[0]
        ms = (4,) if model.table == 3 else (1, 4)
        tiny = QUICK_STAND_IN[family]
        out.append(replace(model, stand_in=tiny, stand_in_title="tiny (--quick)", ks=(2, 4), ms=ms))
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny stand-ins, seconds (for tests)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "table2")
    p.add_argument("--steps", type=int, help="optimizer steps per measured run (default 6)")
    p.add_argument("--only", nargs="+", help="model keys to run (default: all four)")
    args = p.parse_args(argv)
    models = quick_models() if args.quick else MODELS
    models = tuple(m for m in models if not args.only or m.key in args.only)
    steps, repeats = args.steps or (2 if args.quick else 6), 1 if args.quick else 3
    max_batch = 64 if args.quick else 4096
    load_start, started = os.getloadavg()[0], datetime.datetime.now()
    results = {m.key: Results() for m in models}
    for model in models:
        collect(run_sweep(model, steps, args.out), results[model.key])
        cpu_simulation(model, repeats, results[model.key])
        device_simulation(model, max_batch, results[model.key])
    header = (
        f"# GPipe Tables 2 and 3, reproduced{' (--quick: tiny stand-ins)' if args.quick else ''}"
        f"\n\n`python recipes/table2_throughput.py{' --quick' if args.quick else ''}`, "
        f"{started:%Y-%m-%d %H:%M}, torch {torch.__version__}, {os.cpu_count()} CPUs (shared), "
        f"no GPU; load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end. "
        f"Measured: {steps} optimizer steps per job (first left out). (x): normalized. "
        "Paper and torchgpipe columns are quoted, not run.\n"
    )
    text = report(models, results, header)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table2.md").write_text(text + "\n")
    plot(models, results, args.out / "table2.png")
    print(text)
    ok = all(results[m.key].measured for m in models)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
