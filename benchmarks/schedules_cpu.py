"""Schedules on CPU stand-ins, K=2: measured throughput against the simulator's prediction.

    python benchmarks/schedules_cpu.py            # ~3-6 min on 2 cores
    python benchmarks/schedules_cpu.py --quick    # seconds, a smoke test

Model: an 8-block MLP (Linear 1024 + ReLU per block), batch 512, K=2 workers on two CPU stand-in
devices (one intra-op thread each), re-materialization 'never' (``--checkpoint`` to change).
Schedules gpipe, 1f1b, interleaved (V=2: four stages of two blocks), zb-h1 and zb-v (V=2, the
four stages placed in a V), M in {2, 4, 8}.

Every round visits every configuration in turn: ``pipe.predict(x, y, loss)`` (profile the
stages, simulate the schedule), then ``--steps`` timed ``train_step`` calls. This machine is
shared and noisy, so rounds interleave the configurations and the table reports medians over
rounds: measured samples/s (batch / wall time of train_step), predicted samples/s (batch /
simulated step time), the gap between them (the median over rounds of each round's ratio, so
the load of the moment cancels), measured and predicted bubble, the measured CPU contention, and
the peak activation memory of each worker as the executor counts it, measured / predicted.
Timelines of the simulated steps and of each configuration's last measured step go to
outputs/schedules_cpu/ as PNG ({schedule}_k2_m{M}.png, {schedule}_k2_m{M}_measured.png).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.perf.timeline import plot_measured, plot_timeline


@dataclass(frozen=True)
class Setup:
    width: int
    blocks: int
    batch: int
    chunks: tuple[int, ...]
    rounds: int
    steps: int


FULL = Setup(width=1024, blocks=8, batch=512, chunks=(2, 4, 8), rounds=5, steps=3)
QUICK = Setup(width=64, blocks=8, batch=32, chunks=(2, 4), rounds=1, steps=1)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))


@dataclass
class Samples:
    measured: list[float] = field(default_factory=list)  # seconds per step (wall)
    predicted: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    predicted_bubble: list[float] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    predicted_memory: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # per round: predicted / measured - 1
    contention: list[float] = field(default_factory=list)


def mlp(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]
    )


def build(setup: Setup, schedule: str, v: int, chunks: int, checkpoint: str) -> GPipe:
    stages = 2 * v
    return GPipe(
        mlp(setup.width, setup.blocks),
        [setup.blocks // stages] * stages,
        devices=["cpu", "cpu"],
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=v,
    )


def visit(pipe: GPipe, x: torch.Tensor, y: torch.Tensor, steps: int, into: Samples) -> None:
    """One round of one configuration: a prediction, then a warm-up and ``steps`` steps."""
    loss = nn.functional.mse_loss
    prediction = pipe.predict(x, y, loss)
    into.predicted.append(prediction.step_time_s)
    into.predicted_bubble.append(prediction.bubble)
    into.predicted_memory = prediction.simulation.peak_activation_bytes
    into.contention.append(prediction.contention)
    pipe.train_step(x, y, loss)
    walls = []
    for _ in range(steps):
        pipe.zero_grad(set_to_none=True)
        start = time.perf_counter()
        pipe.train_step(x, y, loss)
        walls.append(time.perf_counter() - start)
        assert pipe.last_stats is not None
        into.bubble.append(pipe.last_stats.bubble)
        into.memory = pipe.last_stats.peak_memory_bytes
    into.measured += walls
    # samples/s predicted over measured, within one round: the load of the moment cancels
    into.gaps.append(statistics.median(walls) / prediction.step_time_s - 1)


def run(setup: Setup, checkpoint: str, out: Path) -> dict[tuple[str, int], Samples]:
    torch.set_num_threads(2)  # one intra-op thread per worker
    x, y = torch.randn(setup.batch, setup.width), torch.randn(setup.batch, setup.width)
    configs = [(s, v, m) for s, v in SCHEDULES for m in setup.chunks]
    pipes = {(s, m): build(setup, s, v, m, checkpoint) for s, v, m in configs}
    results = {(s, m): Samples() for s, _, m in configs}
    for r in range(setup.rounds):
        for s, _, m in configs:
            visit(pipes[s, m], x, y, setup.steps, results[s, m])
        print(f"round {r + 1}/{setup.rounds} done", flush=True)
    for s, _, m in configs:
        pipe = pipes[s, m]
        sim = pipe.predict(x, y, nn.functional.mse_loss).simulation
        plot_timeline(sim, out / f"{s}_k2_m{m}.png", title=f"{s}, K=2, M={m} (simulated)")
        name, title = f"{s}_k2_m{m}_measured.png", f"{s}, K=2, M={m} (measured, last step)"
        plot_measured(pipe.last_timings, pipe.step_schedule(), out / name, title=title)
    return results


def table(setup: Setup, results: dict[tuple[str, int], Samples]) -> str:
    mib = 2**20
    lines = [
        "| schedule | M | measured samples/s | predicted samples/s | gap (paired) "
        "| measured bubble | predicted bubble | contention "
        "| peak act. MiB per worker (measured / predicted) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (s, m), r in results.items():
        measured = setup.batch / statistics.median(r.measured)
        predicted = setup.batch / statistics.median(r.predicted)
        mem = ", ".join(
            f"{a / mib:.1f} / {b / mib:.1f}" for a, b in zip(r.memory, r.predicted_memory)
        )
        lines.append(
            f"| {s} | {m} | {measured:.0f} | {predicted:.0f} | {statistics.median(r.gaps):+.1%} "
            f"| {statistics.median(r.bubble):.3f} | {statistics.median(r.predicted_bubble):.3f} "
            f"| {statistics.median(r.contention):.2f} | {mem} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--checkpoint", default="never", choices=["always", "except_last", "never"])
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--out", type=Path, default=Path("outputs/schedules_cpu"))
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    if args.rounds:
        setup = Setup(**{**setup.__dict__, "rounds": args.rounds})
    started = time.perf_counter()
    results = run(setup, args.checkpoint, args.out)
    print(
        f"\nK=2 CPU stand-ins, MLP {setup.blocks}x{setup.width}, batch {setup.batch}, "
        f"checkpoint {args.checkpoint}, median of {setup.rounds} rounds x {setup.steps} steps "
        f"({time.perf_counter() - started:.0f}s)\n"
    )
    print(table(setup, results))


if __name__ == "__main__":
    main()
