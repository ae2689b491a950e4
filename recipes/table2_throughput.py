# Command:  python recipes/table2_throughput.py            (full: 20-40 min on 2 shared cores)
#           python recipes/table2_throughput.py --quick    (tiny stand-ins; what the tests run)
#           python recipes/table2_throughput.py --device-only    (the device model alone, ~1 min)
# Hardware: any CPU. Measured cells: K=2 CPU stand-in devices (one core each) training small
#           stand-ins of the paper's models, as Hydra multirun jobs (train.py -m sweep=table2).
#           Simulated cells: the engine's simulator fed (a) by per-layer costs of the same
#           stand-ins measured on this CPU, (b) by per-layer FLOPs and bytes of the full-size
#           models on a device model with cited constants (--device: tpu-like, p40, v100, p100).
# Reproduces: GPipe Table 2, normalized throughput (K=2, M=1 is 1): AmoebaNet-D (18,256)
#           1.21 / 1.84 / 3.48 and Transformer-48 1.8 / 3.4 / 6.3 at M=32 for K = 2 / 4 / 8;
#           Table 3 (PCIe, M=32, K=2 is 1): AmoebaNet-D (18, 128) 1 / 1.7 / 2.7, Transformer-24
#           1 / 1.8 / 3.3; torchgpipe's 8 x P40 re-run of AmoebaNet-D (18,256), 26.7 samples/s
#           (1x) ... 132.4 samples/s (4.95x), in raw samples/s.
"""GPipe Tables 2 and 3: throughput against K partitions and M micro-batches.

Every number in our columns comes from running code, each cell labelled by its column:

- ``measured``: samples/s of a real training run (``summary.json``, first step left out) of a
  CPU stand-in of the model at K=2 on two CPU stand-in devices; one Hydra multirun per model,
  ``python train.py -m sweep=table2 recipe=...`` (``sweep=table2_pcie`` for Table 3).
- ``simulated (CPU profile)``: the same stand-in, each layer profiled alone on one core of this
  machine at each micro-batch size, cut into K stages by measured time, and the GPipe schedule
  simulated (one core per stage, no contention, no executor overhead).
- ``simulated (device)``: the full-size model's per-layer FLOPs and bytes (measured on the meta
  device, :func:`giantpipe.perf.costs.measure_layers`) on a device model
  (:class:`giantpipe.perf.costs.DeviceModel`: peak FLOP/s x an efficiency that grows with the
  micro-batch, a memory-bandwidth term for layers without FLOPs, a per-layer and a per-action
  overhead; :class:`giantpipe.perf.planner.DeviceSpec`: memory and link). Every constant is a
  flag, and each preset (:data:`PRESETS`) says where each constant comes from.
  Re-materialization as the paper ran it: ``always``, M = 1 included. The paper's cells: the
  batch is adjusted to fit memory (the fastest power-of-two multiple of M that fits) and the
  model is cut as the paper's partitioner cuts it, by estimated FLOPs (``--balance flops``;
  ``time`` cuts by the device model's seconds). torchgpipe's cells: its own batch, balance and
  re-materialization per cell, on the P40 preset, compared in raw samples/s.

Quoted, not run: the paper's Tables 2 and 3 (Huang et al., "GPipe", arXiv 1811.06965 v5) and
torchgpipe's benchmark of AmoebaNet-D (18, 256) on 8 x P40 (kakaobrain/torchgpipe v0.0.7,
docs/benchmarks.rst), normalized as torchgpipe does: samples/s over its K=2, M=1 cell (26.7).
Writes ``results/table2/table2.md`` and ``results/table2/table2.png`` (``--device-only``:
``device.md`` and ``device.png``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.testing.outputs import add_output_options, output_path  # noqa: E402

GIB = 2**30


@dataclass(frozen=True)
class Preset:
    """A device for the FLOP-and-byte model; ``sources`` says where each constant comes from."""

    title: str
    peak_flops: float  # FLOP/s
    memory_gib: float  # per device
    memory_bandwidth: float  # bytes/s, the device's own memory
    link_bandwidth: float  # bytes/s to the next device
    efficiency: float  # share of peak at large micro-batches (DeviceModel)
    half_batch: float  # micro-batch at half that share (0: constant)
    layer_overhead: float  # seconds per layer and action (kernel launches)
    action_overhead: float  # seconds per pipeline action (the executor's hand-over)
    reserve: float  # share of memory kept for context, workspace and fragmentation
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def spec(self) -> DeviceSpec:
        return DeviceSpec(
            peak_flops=self.peak_flops, memory_bytes=self.memory_gib * GIB,
            link_bandwidth=self.link_bandwidth, efficiency=self.efficiency,
            layer_overhead=self.layer_overhead, reserve=self.reserve,
        )  # fmt: skip

    def model(self) -> DeviceModel:
        return DeviceModel(self.peak_flops, self.memory_bandwidth, self.efficiency,
                           self.half_batch, self.layer_overhead)  # fmt: skip


P40_FIT = (
    "fitted: least worst residual over torchgpipe's P40 cells but K=4, M=4, which no setting "
    "reaches (docs/paper-tables.md)"
)
PRESETS = {
    "p40": Preset(
        "Tesla P40 24GB, PCIe", 12e12, 24, 346e9, 6e9, 0.33, 0.0, 200e-6, 0.0, 0.1,
        {"peak_flops": "NVIDIA Tesla P40 datasheet: 12 TFLOPS fp32 (boost)",
         "memory_gib": "NVIDIA Tesla P40 datasheet: 24 GB GDDR5",
         "memory_bandwidth": "NVIDIA Tesla P40 datasheet: 346 GB/s",
         "link_bandwidth": P40_FIT + "; below PCIe 3.0 x16's 15.75 GB/s",
         "efficiency": P40_FIT, "half_batch": P40_FIT, "layer_overhead": P40_FIT,
         "action_overhead": "0: torchgpipe's actions are CUDA launches, counted per layer",
         "reserve": "planner default (DeviceSpec.reserve)"},
    ),
    "v100": Preset(
        "V100-SXM2 32GB, NVLink", 15.7e12, 32, 900e9, 50e9, 0.33, 0.0, 200e-6, 0.0, 0.1,
        {"peak_flops": "NVIDIA V100 datasheet: 15.7 TFLOPS fp32 (SXM2)",
         "memory_gib": "NVIDIA V100 datasheet: 32 GB HBM2",
         "memory_bandwidth": "NVIDIA V100 datasheet: 900 GB/s",
         "link_bandwidth": "NVIDIA V100 datasheet: NVLink 300 GB/s over 6 links both ways; "
                           "2 links one way = 50 GB/s",
         "efficiency": "P40 fit (no V100 cell to fit)", "half_batch": "P40 fit",
         "layer_overhead": "P40 fit", "action_overhead": "as P40",
         "reserve": "planner default (DeviceSpec.reserve)"},
    ),
    "p100": Preset(
        "P100-PCIe 16GB", 9.3e12, 16, 732e9, 6e9, 0.33, 0.0, 200e-6, 0.0, 0.1,
        {"peak_flops": "NVIDIA Tesla P100 datasheet: 9.3 TFLOPS fp32 (PCIe)",
         "memory_gib": "NVIDIA Tesla P100 datasheet: 16 GB CoWoS HBM2 (PCIe)",
         "memory_bandwidth": "NVIDIA Tesla P100 datasheet: 732 GB/s",
         "link_bandwidth": "P40 fit (same PCIe 3.0 x16; the paper's Table 3: no NVLink)",
         "efficiency": "P40 fit", "half_batch": "P40 fit", "layer_overhead": "P40 fit",
         "action_overhead": "as P40", "reserve": "planner default (DeviceSpec.reserve)"},
    ),
    "tpu-like": Preset(
        "TPU-like core (assumed)", 61.5e12, 32, 450e9, 70e9, 0.5, 0.0, 100e-6, 0.0, 0.05,
        {"peak_flops": "assumed: Google Cloud TPU v3 docs, 123 TFLOPS bf16 per chip, 2 cores "
                       "(the paper says TPUs for Table 2, not which version)",
         "memory_gib": "assumed: one TPU v3 chip's 32 GiB HBM (a 16 GiB core cannot hold "
                       "Transformer-48 at K=2: 2.55B parameters x 12 bytes)",
         "memory_bandwidth": "assumed: half of a TPU v3 chip's 900 GB/s HBM",
         "link_bandwidth": "assumed: order of TPU v3 inter-chip links (not published per link)",
         "efficiency": "assumed: 0.5 of peak", "half_batch": "searched: 0 fits best",
         "layer_overhead": "searched: 100 us", "action_overhead": "0 (XLA runs whole stages)",
         "reserve": "0.05: XLA plans memory ahead, little fragmentation"},
    ),
}  # fmt: skip
DEFAULT_PRESET = {"paper": "tpu-like", "torchgpipe": "p40", "table3": "p100"}


FLAGS = {  # flag -> (Preset field, unit): every constant of the device model
    "peak_tflops": ("peak_flops", 1e12), "memory_gib": ("memory_gib", 1),
    "memory_gbps": ("memory_bandwidth", 1e9), "link_gbps": ("link_bandwidth", 1e9),
    "efficiency": ("efficiency", 1), "half_batch": ("half_batch", 1),
    "layer_overhead_us": ("layer_overhead", 1e-6), "action_overhead_us": ("action_overhead", 1e-6),
    "reserve": ("reserve", 1),
}  # fmt: skip


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny stand-ins, seconds (for tests)")
    p.add_argument("--device-only", action="store_true",
                   help="only the full-size models on the device model (no CPU runs)")  # fmt: skip
    add_output_options(p, "table2")
    p.add_argument("--steps", type=int, help="optimizer steps per measured run (default 6)")
    p.add_argument("--only", nargs="+", help="model keys to run (default: all four)")
    p.add_argument("--device", choices=sorted(PRESETS),
                   help="preset for the paper's cells (default: tpu-like for Table 2, p100 for "
                        "Table 3; torchgpipe's cells always run on p40)")  # fmt: skip
    p.add_argument("--balance", choices=("flops", "time"), default="flops",
                   help="how the paper's cells are cut (default: by FLOPs, as the paper's "
                        "partitioner estimates cost)")  # fmt: skip
    for flag, (name, unit) in FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=float,
                       help=f"override the preset's {name} (in units of {unit:g})")  # fmt: skip
    args = p.parse_args(argv)
    args.out = output_path(args, ROOT, "table2")
    return args


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
from torch import nn

from giantpipe.engine.microbatch import scatter  # noqa: E402
from giantpipe.engine.schedules.fill_drain import fill_drain  # noqa: E402
from giantpipe.perf.balance import solve_balance  # noqa: E402
from giantpipe.perf.batch_fit import Fit, fastest_batch  # noqa: E402
from giantpipe.perf.costs import DeviceModel, LayerCost, measure_layers  # noqa: E402
from giantpipe.perf.planner import DeviceSpec, combine, merge_costs  # noqa: E402
from giantpipe.perf.simulate import StageCost, simulate  # noqa: E402
from giantpipe.perf.stage_profile import profile_stages  # noqa: E402
from recipes.model_sizes import build as build_full_size  # noqa: E402

Cell = tuple[int, int]  # (K, M)


# Quoted from the paper (Tables 2 and 3) and torchgpipe's benchmarks (8x P40).
PAPER = {
    "amoebanet_t2": {(2, 1): 1, (4, 1): 1.13, (8, 1): 1.38, (2, 4): 1.07, (4, 4): 1.26,
                     (8, 4): 1.72, (2, 32): 1.21, (4, 32): 1.84, (8, 32): 3.48},
    "transformer_t2": {(2, 1): 1, (4, 1): 1.07, (8, 1): 1.3, (2, 4): 1.7, (4, 4): 3.2,
                       (8, 4): 4.8, (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3},
    "amoebanet_t3": {(2, 32): 1, (4, 32): 1.7, (8, 32): 2.7},
    "transformer_t3": {(2, 32): 1, (4, 32): 1.8, (8, 32): 3.3},
}  # fmt: skip
# (K, M) -> (batch, samples/s, speed-up, balance, re-materialization), AmoebaNet-D (18,256) on
# 8 x P40 (torchgpipe docs/benchmarks.rst); speed-up = samples/s over the K=2, M=1 cell's 26.7.
TORCHGPIPE = {
    (2, 1): (96, 26.7, 1.0, (7, 17), "always"),
    (2, 4): (256, 41.1, 1.54, (9, 15), "except_last"),
    (2, 32): (1280, 47.4, 1.77, (9, 15), "except_last"),
    (4, 1): (160, 26.8, 1.0, (3, 4, 5, 12), "always"),
    (4, 4): (360, 44.5, 1.67, (3, 6, 7, 8), "except_last"),
    (4, 32): (1152, 72.4, 2.71, (3, 6, 7, 8), "except_last"),
    (8, 1): (196, 24.9, 0.93, (2, 2, 2, 2, 2, 3, 4, 7), "always"),
    (8, 4): (480, 70.1, 2.62, (2, 2, 2, 3, 3, 4, 4, 4), "except_last"),
    (8, 32): (1280, 132.4, 4.95, (2, 2, 2, 3, 3, 4, 4, 4), "except_last"),
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
    device: str  # a key of PRESETS: the device of the paper's cells
    ks: tuple[int, ...] = (2, 4, 8)
    ms: tuple[int, ...] = (1, 4, 32)

    @property
    def cells(self) -> list[Cell]:
        return [(k, m) for m in self.ms for k in self.ks]


AMOEBA_CPU = ("data.image_size=64", "data.num_classes=100", "data.batch_size=32")
LM_CPU = ("model.d_model=64", "model.ffn_dim=256", "model.num_heads=4", "data.vocab_size=512",
          "data.seq_len=32", "data.batch_size=32")  # fmt: skip
PAPER_DEVICE, PCIE_DEVICE = DEFAULT_PRESET["paper"], DEFAULT_PRESET["table3"]
MODELS = (
    Model("amoebanet_t2", "AmoebaNet-D (18, 256)", 2, "amoebanet_d_speed", "table2",
          ("model.num_filters=32", *AMOEBA_CPU), "AmoebaNet-D (18, 32), 64 px, batch 32",
          ("amoebanet-d", 18, 256), PAPER_DEVICE),
    Model("transformer_t2", "Transformer-48", 2, "transformer_lm_scaling", "table2",
          ("model.num_layers=48", *LM_CPU), "Transformer-48, d 64, FFN 256, 32 tokens, batch 32",
          ("transformer-l", 48, 0), PAPER_DEVICE),
    Model("amoebanet_t3", "AmoebaNet-D (18, 128)", 3, "amoebanet_d_speed", "table2_pcie",
          ("model.num_filters=16", *AMOEBA_CPU), "AmoebaNet-D (18, 16), 64 px, batch 32",
          ("amoebanet-d", 18, 128), PCIE_DEVICE, ms=(32,)),
    Model("transformer_t3", "Transformer-24", 3, "transformer_lm_scaling", "table2_pcie",
          ("model.num_layers=24", *LM_CPU), "Transformer-24, d 64, FFN 256, 32 tokens, batch 32",
          ("transformer-l", 24, 0), PCIE_DEVICE, ms=(32,)),
)  # fmt: skip
TOLERANCE = 0.15  # the bar: each preset reproduces its measured cells within 15%
# Cells the device model does not reach, and what it lacks there (from the runs in
# results/table2; docs/paper-tables.md says how they were found). Each note is a template whose
# fields :func:`facts` fills with the cell's own numbers. What was tried and did not reach them
# (device-only runs of the tpu-like preset on AmoebaNet-D, 2026-12-03): a per-action cost
# (--action-overhead-us 5000 and 20000) moves the M=4 cells the wrong way (K=2, M=4: +26% and
# +32% against +23%); an efficiency that grows with the micro-batch (--half-batch 78, the value
# at which a micro-batch of 128 runs 1.38x as fast per sample as one of 64) brings K=8, M=1 to
# -13% but sends K=8, M=4 to +78% (4 of 9 cells within 15%, as with 0); a device of 8 or 16 GiB
# (a TPU v2 or v3 core: smaller batches) leaves 4 of 9, M=4 at +23-49%. Too small to matter
# [derived]: the optimizer step (RMSProp reads and writes 20 B a parameter: 15M parameters a
# stage at K=8 take 0.7 ms at 450 GB/s) and link latency (10 us a message, 2 (M+K-1) = 22
# messages at K=8, M=4: 0.2 ms) against K=8, M=4's simulated 3.1 s step; the loss is one
# 1000-way softmax a sample. Memory traffic of BatchNorm and concatenation scales with the
# samples, as the FLOPs do, so it cannot lower M=4's gain over M=1 at a fixed K either.
GROWS_WITH_BATCH = (
    "the paper's {paper:g} is {of_ideal:.2f}x the bubble model's {ideal:.2f}, the most K "
    "stages gain at M={m} at a flat efficiency: per sample, the paper's device ran "
    "{of_ideal:.2f}x as fast as at K=2, M=1, which only a batch and an efficiency that both grow "
    "with K explain (the paper does not publish its batches)"
)
BELOW_BUBBLE_MODEL = (
    "micro-batching gains the paper {gain:.2f}x over M=1 at K={k}, against the bubble model's "
    "{bubble_gain:.2f}x and the simulation's {sim_gain:.2f}x: a cost that grows with M at a "
    "fixed K which the device model lacks; a per-action cost is not it (--action-overhead-us "
    "5000 or 20000 moves K=2, M=4 from +23% to +26% or +32%)"
)
MISSING: dict[tuple[str, Cell], str] = {
    ("amoebanet_t2", (8, 1)): GROWS_WITH_BATCH + "; --half-batch 78 reaches this cell (-13%) "
    "but sends K=8, M=4 to +78%",
    ("amoebanet_t2", (2, 4)): BELOW_BUBBLE_MODEL,
    ("amoebanet_t2", (4, 4)): BELOW_BUBBLE_MODEL,
    ("amoebanet_t2", (8, 4)): BELOW_BUBBLE_MODEL,
    ("amoebanet_t2", (4, 32)): "at the edge ({error:+.1%}): the simulated cut {balance} is "
    "FLOP-even; the paper's is not published, and the paper calls its partitioner imperfect",
    ("transformer_t2", (4, 4)): GROWS_WITH_BATCH,
    ("transformer_t2", (8, 4)): GROWS_WITH_BATCH,
    ("torchgpipe", (4, 4)): "torchgpipe's own speed-up here is {of_ideal:.2f} of the bubble "
    "model's, against {k2:.2f} at K=2 and {k8:.2f} at K=8 with the same M, and its M=32 cell at "
    "the same balance is within 10% here: a cost of this run alone, which no device constant "
    "fitted to all nine cells can have",
}
BREAKDOWN = ("recompute_share", "stage_imbalance", "bubble", "expected_bubble")
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
    breakdown: dict[Cell, dict[str, float]] = field(default_factory=dict)  # Section 3.1
    cpu_sim: dict[Cell, float] = field(default_factory=dict)  # samples/s
    device_sim: dict[Cell, Fit] = field(default_factory=dict)  # the paper's cells
    torchgpipe_sim: dict[Cell, float] = field(default_factory=dict)  # samples/s, P40 cells


# ---- measured: a Hydra multirun per model ---------------------------------------------------


def run_sweep(model: Model, steps: int, out: Path, extra: Sequence[str] = ()) -> Path:
    """``train.py -m sweep=...`` at K=2 on CPU stand-ins; returns the sweep directory."""
    sweep_dir = out / "runs" / model.key
    # A fresh sweep: the runner refuses a job directory that holds an earlier run's record, and
    # ``collect`` would then read that earlier run's summary.json as if it were this run's.
    shutil.rmtree(sweep_dir, ignore_errors=True)
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


EVAL_NOTE = (
    "note: eval loss {low:.3g} to {high:.3g} above is BatchNorm's, not learning's: {steps} SGD "
    "steps on random pixels scaled up the activations before some BatchNorms; training "
    "normalizes by the batch, eval mode by running statistics moved a few times at momentum "
    "0.1, so it amplifies at each of them (batch statistics give a few nats on the same "
    "weights). samples/s is unaffected."
)


def eval_note(summaries: Sequence[dict[str, Any]]) -> str | None:
    """The line printed beside the jobs' own eval figures (each job prints its summary): why
    an AmoebaNet stand-in's eval loss after a few steps is huge (1e6 to 1e33); None for models
    without BatchNorm (the Transformers' is near chance, ln of the vocabulary)."""
    amoeba = [s for s in summaries if str(s.get("name", "")).startswith("amoebanet")]
    losses = [float(s["eval/loss"]) for s in amoeba if "eval/loss" in s]
    if not losses:
        return None
    steps = max(int(s.get("steps", 0)) for s in amoeba)
    return EVAL_NOTE.format(low=min(losses), high=max(losses), steps=steps)


def collect(sweep_dir: Path, results: Results) -> None:
    """Reads each job's summary.json into the measured cells (failed jobs are left out)."""
    completed = []
    for path in sorted(sweep_dir.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("status") != "completed":
            print(f"warning: {path.parent} did not complete: {summary.get('error')}")
            continue
        completed.append(summary)
        cell = (len(summary["pipeline/devices"]), int(summary["pipeline/chunks"]))
        results.measured[cell] = float(summary["train/samples_per_s"])
        results.measured_bubble[cell] = float(summary.get("pipeline/bubble", float("nan")))
        results.breakdown[cell] = {k: float(summary.get(f"pipeline/{k}", float("nan")))
                                   for k in BREAKDOWN}  # fmt: skip
    note = eval_note(completed)
    if note:
        print(note)


# ---- simulated from a per-layer profile on this CPU ----------------------------------------


def compose(recipe: str, overrides: Sequence[str]) -> Any:
    """The experiment config the runner would build for these overrides (dataclasses)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from giantpipe.cli.checks import to_experiment
    from giantpipe.cli.registration import register_configs

    register_configs(ROOT / "conf")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return to_experiment(hydra_compose("config", [f"recipe={recipe}", *overrides]))


def stand_in(model: Model) -> tuple[nn.Sequential, Any, Any, Any, str]:
    """The stand-in model, one training batch and the loss, exactly as the measured runs."""
    from giantpipe.runner.losses import build_loss
    from giantpipe.runner.registry import build_from_target
    from giantpipe.testing.reference import plain_model

    cfg = compose(model.recipe, model.stand_in)
    torch.manual_seed(cfg.trainer.seed)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = build_from_target(cfg.data, "data", run_dir=Path(tmp))
    net = plain_model(cfg, bundle).train()
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
    """A stage of consecutive profiled layers, by the planner's rule: times add up; it keeps its
    input and every inner input (a profile does not say which of them autograd saves)."""
    return merge_costs(layers, sum(c.input_bytes for c in layers[1:]))


def simulate_profile(layers: Sequence[StageCost], k: int, m: int, checkpoint: str) -> float:
    """Seconds per step of GPipe(K, M) on stages cut by measured time from ``layers``."""
    balance = solve_balance([c.forward + c.backward for c in layers], k)
    bounds = [sum(balance[:i]) for i in range(k + 1)]
    stages = [merge(layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    return simulate(fill_drain(k, m), stages, checkpoint).step_time


def cpu_simulation(model: Model, repeats: int, results: Results) -> None:
    net, inputs, targets, loss, checkpoint = stand_in(model)
    total = int(targets.shape[0])
    torch.set_num_threads(1)
    for m in model.ms:
        x, y = scatter(inputs, m)[0], scatter(targets, m)[0]
        layers = profile_layers(net, x, y, loss, repeats)
        for k in model.ks:
            results.cpu_sim[(k, m)] = total / simulate_profile(layers, k, m, checkpoint)


# ---- simulated on a device model, full-size model ------------------------------------------


def device_cell(
    layers: Sequence[LayerCost],
    k: int,
    m: int,
    batch: int,
    balance: Sequence[int],
    preset: Preset,
    checkpoint: str = "always",
) -> float:
    """Samples/s of GPipe(K, M) on ``preset`` for a given batch and balance."""
    micro = batch // m
    times = preset.model().layer_times(layers)(micro)
    link, latency = preset.link_bandwidth, preset.spec().link_latency
    parts = [StageCost(forward=f, backward=b + w, backward_input=b, weight=w,
                       send=c.output_bytes * micro / link + latency)
             for c, (f, b, w) in zip(layers, times, strict=True)]  # fmt: skip
    bounds = list(itertools.accumulate([0, *balance]))
    stages = [combine(parts[a:b], layers[a:b], micro) for a, b in itertools.pairwise(bounds)]
    step = simulate(fill_drain(k, m), stages, checkpoint, preset.action_overhead).step_time
    return batch / step


def fit_batch(
    layers: Sequence[LayerCost],
    k: int,
    m: int,
    preset: Preset,
    max_batch: int,
    balance_by: str = "flops",
    checkpoint: str = "always",
) -> Fit | None:
    """The fastest batch m * 2^j up to ``max_batch`` that fits in memory (the paper adjusted
    the batch "to fit memory"), re-materializing as ``checkpoint`` says
    (:func:`giantpipe.perf.batch_fit.fastest_batch`). The planner cuts the model within memory
    by ``balance_by``: 'flops' (the paper's partitioner estimates cost from FLOPs;
    bandwidth-bound layers then weigh more than it thinks) or 'time' (the device model's
    seconds); the cut is then timed on the full device model."""
    model = preset.model()
    if balance_by == "flops":  # the same model without the terms that are not FLOPs
        model = replace(model, memory_bandwidth=math.inf, layer_overhead=0.0)
    elif balance_by != "time":
        raise ValueError(f"balance_by must be 'flops' or 'time', not {balance_by!r}")

    def rate(batch: int, balance: Sequence[int]) -> float:
        return device_cell(layers, k, m, batch, balance, preset, checkpoint)

    return fastest_batch(layers, k, m, preset.spec(), model.layer_times(layers), rate, max_batch,
                         checkpoint)  # fmt: skip


def full_size_costs(model: Model) -> list[LayerCost]:
    """Per-layer FLOPs and bytes of the paper's model (one sample, on the meta device)."""
    name, layers, filters = model.full_size
    net, sample = build_full_size(name, layers, filters or 256)
    return measure_layers(net, sample, loss_saves_output=True)


def device_simulation(
    model: Model,
    preset: Preset,
    max_batch: int,
    balance_by: str,
    results: Results,
    presets: dict[str, Preset] = PRESETS,
) -> None:
    costs = full_size_costs(model)
    for cell in model.cells:
        fit = fit_batch(costs, *cell, preset, max_batch, balance_by)
        if fit is not None:
            results.device_sim[cell] = fit
    if model.key == "amoebanet_t2":  # torchgpipe re-ran this one: its batch, balance, mode
        p40 = presets[DEFAULT_PRESET["torchgpipe"]]
        for cell in model.cells:
            batch, _, _, balance, checkpoint = TORCHGPIPE[cell]
            results.torchgpipe_sim[cell] = device_cell(costs, *cell, batch, balance, p40,
                                                       checkpoint)  # fmt: skip


# ---- the table and the plot -----------------------------------------------------------------


def normalized(values: dict[Cell, float], base: Cell) -> dict[Cell, float]:
    return {c: v / values[base] for c, v in values.items()} if base in values else {}


def ideal(cell: Cell, base: Cell) -> float:
    """[derived] the pure bubble model K*M/(M+K-1), normalized to the base cell."""

    def rate(k: int, m: int) -> float:
        return k * m / (m + k - 1)

    return rate(*cell) / rate(*base)


def facts(key: str, cell: Cell, r: Results) -> dict[str, Any]:
    """The numbers a note of :data:`MISSING` quotes for ``cell`` of model ``key`` (or of
    torchgpipe's cells, ``key="torchgpipe"``): the quoted speed-up against the bubble model
    K*M/(M+K-1) (``of_ideal``), the gain over M=1 at the same K quoted, by the bubble model and
    simulated (``gain``, ``bubble_gain``, ``sim_gain``), the simulated residual and cut."""
    k, m = cell
    if key == "torchgpipe":

        def of_ideal(c: Cell) -> float:
            return TORCHGPIPE[c][2] / ideal(c, (2, 1))

        return {"of_ideal": of_ideal(cell), "k2": of_ideal((2, m)), "k8": of_ideal((8, m))}
    paper, base, first = PAPER[key], min(PAPER[key]), (k, min(c[1] for c in PAPER[key]))
    sim = normalized({c: f.samples_per_s for c, f in r.device_sim.items()}, base)
    return {
        "k": k, "m": m, "paper": paper[cell], "ideal": ideal(cell, base),
        "of_ideal": paper[cell] / ideal(cell, base), "gain": paper[cell] / paper[first],
        "bubble_gain": ideal(cell, first),
        "sim_gain": sim[cell] / sim[first] if cell in sim and first in sim else math.nan,
        "error": sim[cell] / paper[cell] - 1 if cell in sim else math.nan,
        "balance": list(r.device_sim[cell].balance) if cell in r.device_sim else "-",
    }  # fmt: skip


def missing(key: str, cell: Cell, r: Results) -> str:
    """What the device model lacks at a cell beyond the tolerance (:data:`MISSING`), with the
    cell's own numbers (:func:`facts`)."""
    note = MISSING.get((key, cell))
    return "not diagnosed" if note is None else note.format(**facts(key, cell, r))


def residual(simulated: float, reference: float) -> str:
    """simulated / reference - 1, as a signed percentage; ``*`` marks one beyond 15%."""
    value = simulated / reference - 1
    return f"{value:+.0%}" + (" *" if abs(value) > TOLERANCE else "")


def device_table(model: Model, r: Results, preset: str) -> tuple[str, list[str]]:
    """The full-size model on the device model beside the paper (and torchgpipe); also the
    notes for cells beyond the tolerance."""
    base = (model.ks[0], model.ms[0])
    dev = normalized({c: f.samples_per_s for c, f in r.device_sim.items()}, base)
    tg = bool(r.torchgpipe_sim)
    head = ["K", "M", "paper (x)", "ideal K·M/(M+K-1) [derived]",
            f"**simulated** {preset}: batch, balance, samples/s (x)", "vs paper",
            *(["torchgpipe P40 (quoted): batch, ckpt, samples/s (x)",
               "**simulated** p40 at torchgpipe's batch, balance, ckpt: samples/s (x)",
               "vs torchgpipe"] if tg else [])]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    notes = []
    for cell in model.cells:
        paper = PAPER[model.key].get(cell)  # --quick runs cells the paper has not
        row = [str(cell[0]), str(cell[1]), "-" if paper is None else f"{paper:g}",
               f"{ideal(cell, base):.2f}"]  # fmt: skip
        if cell in dev:
            fit = r.device_sim[cell]
            row += [f"{fit.batch}, {list(fit.balance)}, {fit.samples_per_s:.1f} ({dev[cell]:.2f})",
                    "-" if paper is None else residual(dev[cell], paper)]  # fmt: skip
            if paper is not None and abs(dev[cell] / paper - 1) > TOLERANCE:
                notes.append(f"K={cell[0]}, M={cell[1]} vs paper: {missing(model.key, cell, r)}")
        else:
            row += ["does not fit", "-"]
        if tg:
            batch, rate, speedup, _, checkpoint = TORCHGPIPE[cell]
            sim = r.torchgpipe_sim[cell]
            row += [
                f"{batch}, {checkpoint}, {rate} ({speedup:.2f})",
                f"{sim:.1f} ({sim / r.torchgpipe_sim[(2, 1)]:.2f})",
                residual(sim, rate),
            ]
            if abs(sim / rate - 1) > TOLERANCE:
                notes.append(f"K={cell[0]}, M={cell[1]} vs torchgpipe: "
                             f"{missing('torchgpipe', cell, r)}")  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines), notes


def cpu_table(model: Model, r: Results) -> str:
    """The CPU stand-in: measured runs with the Section 3.1 breakdown, and the CPU profile's
    simulation."""
    base = (model.ks[0], model.ms[0])
    meas, cpu = normalized(r.measured, base), normalized(r.cpu_sim, base)
    head = ["K", "M", "**measured** CPU: samples/s (x)", "recompute share", "stage imbalance",
            "bubble, measured", "bubble, (K-1)/(M+K-1)",
            "**simulated** CPU profile: samples/s (x)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for cell in model.cells:
        row = [str(cell[0]), str(cell[1])]
        row.append(f"{r.measured[cell]:.2f} ({meas[cell]:.2f})" if cell in meas else "not run")
        parts = r.breakdown.get(cell, {})
        row += [f"{parts[k]:.3f}" if k in parts else "-" for k in BREAKDOWN]
        row.append(f"{r.cpu_sim[cell]:.2f} ({cpu[cell]:.2f})" if cell in cpu else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def within(model: Model, r: Results) -> str:
    """How many simulated cells are within the tolerance of the quoted ones."""
    base = (model.ks[0], model.ms[0])
    dev = normalized({c: f.samples_per_s for c, f in r.device_sim.items()}, base)
    paper = PAPER[model.key]
    ok = sum(abs(dev[c] / paper[c] - 1) <= TOLERANCE for c in dev if c in paper)
    text = f"{ok} of {len(model.cells)} paper cells within {TOLERANCE:.0%}"
    if r.torchgpipe_sim:
        tg = sum(abs(r.torchgpipe_sim[c] / TORCHGPIPE[c][1] - 1) <= TOLERANCE
                 for c in r.torchgpipe_sim)  # fmt: skip
        text += f"; {tg} of {len(r.torchgpipe_sim)} torchgpipe cells (raw samples/s)"
    return text


def preset_table(names: Sequence[str], presets: dict[str, Preset]) -> str:
    """Every constant of the presets used, with its source."""
    lines = ["| preset | constant | value | source |", "|---|---|---|---|"]
    units = {"peak_flops": 1e12, "memory_gib": 1, "memory_bandwidth": 1e9, "link_bandwidth": 1e9,
             "efficiency": 1, "half_batch": 1, "layer_overhead": 1e-6, "action_overhead": 1e-6,
             "reserve": 1}  # fmt: skip
    suffix = {
        "peak_flops": " TFLOP/s",
        "memory_gib": " GiB",
        "memory_bandwidth": " GB/s",
        "link_bandwidth": " GB/s",
        "layer_overhead": " us",
        "action_overhead": " us",
    }
    for name in dict.fromkeys(names):
        preset = presets[name]
        for key, unit in units.items():
            value = getattr(preset, key) / unit
            lines.append(f"| {name} | {key} | {value:g}{suffix.get(key, '')} | "
                         f"{preset.sources.get(key, 'command line')} |")  # fmt: skip
    return "\n".join(lines)


def report(
    models: Sequence[Model],
    results: dict[str, Results],
    header: str,
    presets: dict[str, Preset],
    device: str | None,
) -> str:
    parts = [header]
    used = [device or m.device for m in models]
    if any(results[m.key].torchgpipe_sim for m in models):
        used.append(DEFAULT_PRESET["torchgpipe"])
    for table in (2, 3):
        for model in (m for m in models if m.table == table):
            base = f"K={model.ks[0]}, M={model.ms[0]}"
            r, preset = results[model.key], device or model.device
            text, notes = device_table(model, r, preset)
            parts += [
                f"## Table {table}: {model.title} (normalized to {base})",
                "",
                f"Full size on the device model ({presets[preset].title}), re-materialization "
                f"`always`: {within(model, r)}.",
                "",
                text,
                "",
                *[f"- {n}" for n in notes],
                *([""] if notes else []),
            ]
            if r.measured or r.cpu_sim:
                parts += [
                    f"CPU stand-in: {model.stand_in_title} (`recipe={model.recipe}` "
                    f"`{' '.join(model.stand_in)}`); the measured runs' breakdown as in the "
                    "paper's Section 3.1 (summary.json `pipeline/...`).",
                    "",
                    cpu_table(model, r),
                    "",
                ]
    parts += ["## Device presets and their sources", "", preset_table(used, presets), ""]
    return "\n".join(parts)


def plot(models: Sequence[Model], results: dict[str, Results], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        r, base = results[model.key], (model.ks[0], model.ms[0])
        sources = [("paper", PAPER[model.key], "--", "o"),
                   ("sim. device", normalized({c: f.samples_per_s for c, f in
                                               r.device_sim.items()}, base), "-", "s"),
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


def presets_from(args: argparse.Namespace) -> dict[str, Preset]:
    """The presets with the command line's constants applied to the ``--device`` one (or, with
    no ``--device``, to every preset), each such constant's source then 'command line'."""
    changes = {name: getattr(args, flag) * unit for flag, (name, unit) in FLAGS.items()
               if getattr(args, flag) is not None}  # fmt: skip
    out = dict(PRESETS)
    for key in [args.device] if args.device else list(PRESETS):
        sources = {k: v for k, v in out[key].sources.items() if k not in changes}
        out[key] = replace(out[key], **changes, sources=sources)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    presets = presets_from(args)
    models = quick_models() if args.quick else MODELS
    models = tuple(m for m in models if not args.only or m.key in args.only)
    steps, repeats = args.steps or (2 if args.quick else 6), 1 if args.quick else 3
    max_batch = 64 if args.quick else 4096
    load_start, started = os.getloadavg()[0], datetime.datetime.now()
    results = {m.key: Results() for m in models}
    for model in models:
        if not args.device_only:
            collect(run_sweep(model, steps, args.out), results[model.key])
            cpu_simulation(model, repeats, results[model.key])
        preset = presets[args.device or model.device]
        device_simulation(model, preset, max_batch, args.balance, results[model.key], presets)
    command = " ".join(["python recipes/table2_throughput.py", *(argv or sys.argv[1:])])
    header = (
        f"# GPipe Tables 2 and 3, reproduced{' (--quick: tiny stand-ins)' if args.quick else ''}"
        f"\n\n`{command}`, "
        f"{started:%Y-%m-%d %H:%M}, torch {torch.__version__}, {os.cpu_count()} CPUs (shared), "
        f"no GPU; load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end. "
        f"Measured: {steps} optimizer steps per job (first left out). (x): normalized. "
        "Paper and torchgpipe columns are quoted, not run. `*`: beyond "
        f"{TOLERANCE:.0%}; the note under the table names the effect the model lacks.\n"
    )
    text = report(models, results, header, presets, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "device" if args.device_only else "table2"  # a device-only run keeps the measured one
    (args.out / f"{name}.md").write_text(text + "\n")
    plot(models, results, args.out / f"{name}.png")
    print(text)
    ok = args.device_only or all(results[m.key].measured for m in models)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
