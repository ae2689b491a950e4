"""Samples/s and activation memory of AmoebaNet-D (18, 256) at 224 px on the CPU: plain vs GPipe.

Command:    python recipes/amoebanet_cpu_throughput.py                 (about 10-20 min on 2 cores)
            python recipes/amoebanet_cpu_throughput.py --layers 3 --filters 16 --image-size 64
Hardware:   any CPU; K stages are K CPU stand-ins sharing the machine's cores.
Reproduces: not a paper number (the paper measures TPUs): on CPU stand-ins the pipeline cannot be
            faster than the plain model, as every stage shares the same cores. What it shows is the
            cost of micro-batching and re-materialization (M > 1 splits a small batch further) and
            the activation memory each stage holds, the quantity GPipe trades compute for.

On a machine shared with other jobs, pass ``--threads 1``: with 2 intra-op threads per process
the plain model ran 4x slower at load ~5 on 2 cores (OpenMP threads waiting on each other), which
says nothing about pipelining. Measured with --threads 1 at load ~2-5 on 2 cores: plain 0.58
samples/s, K=1 M=1 0.48, K=2 M=1 0.48, K=1 M=4 0.34, K=2 M=4 0.22; saved activations 3060 MiB
(plain), 769 MiB (K=1 M=4), 610 + 183 MiB (K=2 M=4).

Each row trains ``--steps`` SGD steps (after one warm-up step) on a fixed batch of random pixels
and reports samples/s (optimizer steps included), the step time, the measured bubble, and the
peak bytes of activations saved for backward per stage (``pipe.last_stats``; for the plain
model, everything its forward saves). Rows: the plain model, then K=1 and K=2 for each M.

Example output columns::

    | model | K | M | balance | recompute | samples/s | step (s) | bubble | peak activations |
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=18, help="L, normal cells")
    parser.add_argument("--filters", type=int, default=256, help="D, base filters")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8, help="mini-batch size N")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4], help="values of M")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument(
        "--recompute", "--checkpoint", default="except_last", help="re-materialization mode"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads of the process (K stand-ins share them); default: torch's",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.nn.functional as F
from torch import nn

from giantpipe.engine import GPipe  # noqa: E402
from giantpipe.engine.stats import SavedTensorMeter  # noqa: E402
from giantpipe.perf.balance import balance_by_time  # noqa: E402
from models.amoebanet import amoebanetd  # noqa: E402


@dataclass
class Row:
    """One measured configuration."""

    model: str
    stages: int
    chunks: int
    balance: list[int]
    recompute: str
    samples_per_s: float
    step_time_s: float
    bubble: float | None
    peak_bytes: list[int]


def mib(count: int) -> str:
    return f"{count / 2**20:.0f} MiB"


def build(args: argparse.Namespace) -> nn.Sequential:
    """The model, initialized the same way for every row."""
    torch.manual_seed(0)
    return amoebanetd(args.layers, args.filters, num_classes=1000, image_size=args.image_size)


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=generator)
    return images, torch.randint(1000, (args.batch,), generator=generator)


def timed(step: object, steps: int) -> float:
    """Seconds per call of ``step`` over ``steps`` calls, after one warm-up call."""
    step()  # type: ignore[operator]
    start = time.perf_counter()
    for _ in range(steps):
        step()  # type: ignore[operator]
    return (time.perf_counter() - start) / steps


def plain_row(args: argparse.Namespace) -> Row:
    """The un-pipelined model on all the machine's threads."""
    model, (x, y) = build(args), batch(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saved: list[int] = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        # Everything the forward saves stays until backward: that is the step's peak.
        with SavedTensorMeter(exclude=model.parameters()) as meter:
            loss = F.cross_entropy(model(x), y)
        saved.append(meter.bytes)
        loss.backward()
        optimizer.step()

    seconds = timed(step, args.steps)
    return Row("plain", 1, 1, [len(model)], "-", args.batch / seconds, seconds, None, [saved[-1]])


def pipe_row(args: argparse.Namespace, balance: list[int], chunks: int) -> Row:
    """GPipe over len(balance) CPU stand-ins with M = chunks."""
    model, (x, y) = build(args), batch(args)
    pipe = GPipe(
        model,
        balance=balance,
        devices=["cpu"] * len(balance),
        chunks=chunks,
        recompute=args.recompute,
        deferred_batch_norm=True,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipe.train_step(x, y, F.cross_entropy)
        optimizer.step()

    seconds = timed(step, args.steps)
    stats = pipe.last_stats
    assert stats is not None
    return Row(
        "gpipe",
        len(balance),
        chunks,
        balance,
        args.recompute,
        args.batch / seconds,
        seconds,
        stats.bubble,
        list(stats.peak_memory_bytes),
    )


def table(rows: list[Row], args: argparse.Namespace) -> str:
    head = (
        f"AmoebaNet-D ({args.layers}, {args.filters}), {args.image_size} px, batch {args.batch}, "
        f"SGD, {torch.get_num_threads()} CPU threads, {args.steps} timed steps\n\n"
        "| model | K | M | balance | recompute | samples/s | step (s) | bubble | "
        "peak activations per stage |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        bubble = "-" if r.bubble is None else f"{r.bubble:.2f}"
        peaks = ", ".join(mib(b) for b in r.peak_bytes)
        lines.append(
            f"| {r.model} | {r.stages} | {r.chunks} | {r.balance} | {r.recompute} | "
            f"{r.samples_per_s:.2f} | {r.step_time_s:.2f} | {bubble} | {peaks} |"
        )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    lines.append(f"\nprocess peak RSS: {rss:.0f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = [plain_row(args)]
    print(f"plain: {rows[0].samples_per_s:.2f} samples/s", flush=True)
    images, _ = batch(args)
    # One balance for all K=2 rows: measured forward+backward time per layer on one image.
    two = balance_by_time(2, build(args), images[:1])
    for chunks in args.chunks:
        for balance in ([sum(two)], two):
            rows.append(pipe_row(args, balance, chunks))
            r = rows[-1]
            print(f"K={r.stages} M={chunks}: {r.samples_per_s:.2f} samples/s", flush=True)
    print(table(rows, args))
    if args.json is not None:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")


if __name__ == "__main__":
    main()
