"""Schedules on CPU stand-ins, K=2: measured throughput against the simulator's prediction.

    python benchmarks/schedules_cpu.py            # ~3-6 min on 2 cores
    python benchmarks/schedules_cpu.py --quick    # seconds, a smoke test

Model: an 8-block MLP (Linear 1024 + ReLU per block), batch 512, K=2 workers on two CPU stand-in
devices (one intra-op thread each), re-materialization 'never' (``--recompute`` to change).
Schedules gpipe, 1f1b, interleaved (V=2: four stages of two blocks), zb-h1 and zb-v (V=2, the
four stages placed in a V), M in {2, 4, 8}.

Every round visits every configuration in turn: ``predict(pipe, x, y, loss)`` (profile the
stages, simulate the schedule), then ``--steps`` timed ``train_step`` calls. This machine is
shared and noisy, so rounds interleave the configurations and the table reports medians over
rounds: measured samples/s (batch / wall time of train_step), predicted samples/s (batch /
simulated step time), the gap between them (the median over rounds of each round's ratio, so
the load of the moment cancels), measured and predicted bubble, the measured CPU contention, and
the peak activation memory of each worker as the executor counts it, measured / predicted.
Timelines of the simulated steps and of each configuration's last measured step go to
outputs/schedules_cpu/ as PNG ({schedule}_k2_m{M}.png, {schedule}_k2_m{M}_measured.png).

Beside the MLP, the paper's two models at small sizes (``--no-models`` leaves them out,
``--models-only`` runs them alone; ``--quick`` leaves them out unless ``--models-only``):
AmoebaNet-D (6, 16) on 32 px images, 10 classes, and a 4-layer Transformer LM (d 64, FFN 256,
4 heads, 512-token vocabulary, 32 tokens), each cut into two halves of its layers, batch 64,
GPipe at M = 8 and 32 with re-materialization 'always' (the paper's), measured and forecast the
same way: the forecast error on the paper's models, not only on an MLP.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    parser.add_argument(
        "--recompute", "--checkpoint", default="never", choices=["always", "except_last", "never"]
    )
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--out", type=Path, default=Path("outputs/schedules_cpu"))
    parser.add_argument("--no-models", action="store_true",
                        help="leave out the paper's models (AmoebaNet-D, Transformer)")  # fmt: skip
    parser.add_argument("--models-only", action="store_true",
                        help="only the paper's models, not the MLP's schedules")  # fmt: skip
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
from torch import nn

from giantpipe import GPipe  # noqa: E402
from giantpipe.perf.predict import predict  # noqa: E402
from giantpipe.perf.timeline import plot_measured, plot_timeline  # noqa: E402
from models.amoebanet import amoebanetd  # noqa: E402
from models.transformer_lm import transformer_lm  # noqa: E402


@dataclass(frozen=True)
class Setup:
    width: int
    blocks: int
    batch: int
    chunks: tuple[int, ...]
    rounds: int
    steps: int


FULL = Setup(width=1024, blocks=8, batch=512, chunks=(2, 4, 8), rounds=5, steps=3)
MODEL_CHUNKS, MODEL_BATCH = (8, 32), 64  # the paper's models: M, and the mini-batch
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


def build(setup: Setup, schedule: str, v: int, chunks: int, recompute: str) -> GPipe:
    stages = 2 * v
    return GPipe(
        mlp(setup.width, setup.blocks),
        [setup.blocks // stages] * stages,
        devices=["cpu", "cpu"],
        chunks=chunks,
        recompute=recompute,
        schedule=schedule,
        virtual_stages=v,
    )


def paper_model(name: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    """A small AmoebaNet-D or Transformer LM, one mini-batch and its loss."""
    torch.manual_seed(0)
    if name == "amoebanet":
        model = amoebanetd(6, 16, num_classes=10, image_size=32)
        x = torch.randn(MODEL_BATCH, 3, 32, 32)
        return model, x, torch.randint(0, 10, (MODEL_BATCH,)), nn.functional.cross_entropy
    model = transformer_lm(4, d_model=64, ffn_dim=256, num_heads=4, vocab_size=512, max_len=32)
    tokens = torch.randint(0, 512, (MODEL_BATCH, 33))

    def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    return model, tokens[:, :-1], tokens[:, 1:], lm_loss


def run_models(rounds: int, steps: int) -> dict[tuple[str, int], Samples]:
    """The paper's models at M = 8 and 32 (GPipe, K=2, 'always'), rounds interleaved."""
    torch.set_num_threads(2)
    cells = {}
    for name in ("amoebanet", "transformer"):
        model, x, y, loss = paper_model(name)
        half = len(model) // 2
        for m in MODEL_CHUNKS:
            pipe = GPipe(copy.deepcopy(model), [half, len(model) - half], devices=["cpu", "cpu"],
                         chunks=m, recompute="always")  # fmt: skip
            cells[name, m] = (pipe, x, y, loss)
    results = {key: Samples() for key in cells}
    for r in range(rounds):
        for key, (pipe, x, y, loss) in cells.items():
            visit(pipe, x, y, steps, results[key], loss)
        print(f"paper models: round {r + 1}/{rounds} done", flush=True)
    return results


def visit(
    pipe: GPipe,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    into: Samples,
    loss: Any = nn.functional.mse_loss,
) -> None:
    """One round of one configuration: a prediction, then a warm-up and ``steps`` steps."""
    prediction = predict(pipe, x, y, loss)
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


def run(setup: Setup, recompute: str, out: Path) -> dict[tuple[str, int], Samples]:
    torch.set_num_threads(2)  # one intra-op thread per worker
    x, y = torch.randn(setup.batch, setup.width), torch.randn(setup.batch, setup.width)
    configs = [(s, v, m) for s, v in SCHEDULES for m in setup.chunks]
    pipes = {(s, m): build(setup, s, v, m, recompute) for s, v, m in configs}
    results = {(s, m): Samples() for s, _, m in configs}
    for r in range(setup.rounds):
        for s, _, m in configs:
            visit(pipes[s, m], x, y, setup.steps, results[s, m])
        print(f"round {r + 1}/{setup.rounds} done", flush=True)
    for s, _, m in configs:
        pipe = pipes[s, m]
        sim = predict(pipe, x, y, nn.functional.mse_loss).simulation
        plot_timeline(sim, out / f"{s}_k2_m{m}.png", title=f"{s}, K=2, M={m} (simulated)")
        name, title = f"{s}_k2_m{m}_measured.png", f"{s}, K=2, M={m} (measured, last step)"
        plot_measured(pipe.last_timings, pipe.step_schedule(), out / name, title=title)
    return results


def table(setup: Setup, results: dict[tuple[str, int], Samples], first: str = "schedule") -> str:
    mib = 2**20
    lines = [
        f"| {first} | M | measured samples/s | predicted samples/s | gap (paired) "
        "| measured bubble | predicted bubble | contention "
        "| peak act. MiB per worker (measured / predicted) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    batch = setup.batch if first == "schedule" else MODEL_BATCH
    for (s, m), r in results.items():
        measured = batch / statistics.median(r.measured)
        predicted = batch / statistics.median(r.predicted)
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
    args = parse()
    setup = QUICK if args.quick else FULL
    if args.rounds:
        setup = Setup(**{**setup.__dict__, "rounds": args.rounds})
    started = time.perf_counter()
    if not args.models_only:
        results = run(setup, args.recompute, args.out)
        print(
            f"\nK=2 CPU stand-ins, MLP {setup.blocks}x{setup.width}, batch {setup.batch}, "
            f"recompute {args.recompute}, median of {setup.rounds} rounds x {setup.steps} "
            f"steps ({time.perf_counter() - started:.0f}s)\n"
        )
        print(table(setup, results))
    if args.no_models or (args.quick and not args.models_only):
        return  # --quick: the MLP alone (the paper's models take minutes even small)
    started = time.perf_counter()
    models = run_models(setup.rounds, setup.steps)
    print(
        f"\nThe paper's models, small: K=2 CPU stand-ins, GPipe, batch {MODEL_BATCH}, "
        f"recompute always, median of {setup.rounds} rounds x {setup.steps} steps "
        f"({time.perf_counter() - started:.0f}s); gap: measured step / predicted step - 1\n"
    )
    print(table(setup, models, first="model"))


if __name__ == "__main__":
    main()
