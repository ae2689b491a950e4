# Command:  python recipes/plan_pipeline.py --model amoebanet-d --layers 18 --filters 256 \
#               --devices 8 --memory-gib 16 --batch 512 --peak-tflops 125 --bandwidth-gbps 50
#           python recipes/plan_pipeline.py --model transformer-l --layers 48 --devices 8 \
#               --memory-gib 16 --batch 32 --plot outputs/plan_transformer48.png
# Hardware: any CPU, no GPU: the model is built on the meta device, each candidate simulated
#           (results/planner_speed.md has the time it takes; a progress bar on stderr meanwhile).
# Reproduces: results/plan/ (results/README.md, "Planner's choices"): AmoebaNet-D (18, 256),
#           batch 512 on 8 x 16 GiB: zb-h1, M=32, never, 2374 samples/s, bubble 0.44.
"""Plan a pipeline for a named model: the best balance, M, re-materialization and schedule.

Prints every configuration that fits, fastest first (the planner, :mod:`giantpipe.perf.planner`,
on per-layer FLOPs and bytes measured on the meta device), and with ``--plot`` draws the best
candidate's simulated timeline.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.engine.schedules import SCHEDULE_NAMES  # noqa: E402
from giantpipe.engine.spec import RECOMPUTE_MODES  # noqa: E402

MODELS = ("amoebanet-d", "transformer-l")  # recipes.model_sizes.build's names


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument(
        "--layers", type=int, help="L: AmoebaNet normal cells (18) / Transformer layers (48)"
    )
    p.add_argument("--filters", type=int, default=256, help="D of AmoebaNet-D (L, D)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--devices", type=int, required=True, help="K, devices in the pipeline")
    p.add_argument("--memory-gib", type=float, required=True, help="memory per device")
    p.add_argument("--batch", type=int, required=True, help="mini-batch size")
    p.add_argument("--peak-tflops", type=float, default=125.0, help="peak TFLOP/s per device")
    p.add_argument("--bandwidth-gbps", type=float, default=50.0, help="link GB/s to a neighbour")
    p.add_argument("--efficiency", type=float, default=0.5, help="share of peak on big layers")
    p.add_argument(
        "--layer-overhead-us",
        type=float,
        default=100.0,
        help="microseconds per layer and action (launches, small-batch loss)",
    )
    p.add_argument(
        "--optimizer-slots",
        type=int,
        default=1,
        help="optimizer state per parameter: 1 RMSProp/momentum (12 B/param), 2 Adam",
    )
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULE_NAMES), choices=SCHEDULE_NAMES)
    p.add_argument("--recompute", nargs="+", default=list(RECOMPUTE_MODES), choices=RECOMPUTE_MODES)
    p.add_argument("--chunks", nargs="+", type=int, help="M to try (default: powers of two)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (the fastest)")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.add_argument("--plot", help="write the best candidate's simulated timeline (PNG) here")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

from giantpipe.perf.costs import measure_layers  # noqa: E402
from giantpipe.perf.planner import DeviceSpec, format_table, plan, progress_bar  # noqa: E402
from recipes.model_sizes import build  # noqa: E402

GIB = 2**30


def device_spec(args: argparse.Namespace) -> DeviceSpec:
    """The device model the command line describes."""
    return DeviceSpec(
        peak_flops=args.peak_tflops * 1e12,
        memory_bytes=args.memory_gib * GIB,
        link_bandwidth=args.bandwidth_gbps * 1e9,
        efficiency=args.efficiency,
        layer_overhead=args.layer_overhead_us * 1e-6,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    model, sample = build(args.model, args.layers, args.filters, args.image_size, args.seq_len)
    layers = measure_layers(model, sample)
    with progress_bar(enabled=not args.quiet) as progress:
        candidates = plan(
            layers,
            args.devices,
            args.batch,
            device_spec(args),
            schedules=args.schedules,
            chunks=args.chunks,
            recompute=args.recompute,
            optimizer_slots=args.optimizer_slots,
            top=args.top,
            progress=progress,
        )
    params = sum(c.params for c in layers)
    print(
        f"{args.model} ({len(layers)} layers, {params / 1e6:.1f}M parameters, "
        f"{sum(c.flops for c in layers) / 1e9:.1f} GFLOP forward per sample) on "
        f"{args.devices} x {args.memory_gib:g} GiB, {args.peak_tflops:g} TFLOP/s, "
        f"{args.bandwidth_gbps:g} GB/s; batch {args.batch}; "
        f"{candidates.fitting} configurations fit ({time.perf_counter() - started:.1f}s)\n"
    )
    if not candidates:
        print("nothing fits: add devices or memory, or lower the batch size")
        return 1
    print(format_table(candidates[: args.top]))
    if args.plot:
        from giantpipe.perf.timeline import plot_timeline

        best = candidates[0]
        out = plot_timeline(
            best.simulation,
            args.plot,
            title=f"{args.model}: {best.schedule}, M={best.chunks}, {best.recompute} (simulated)",
        )
        print(f"\ntimeline of the best candidate: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
