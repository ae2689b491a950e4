"""Engine benchmark on CPU stand-in devices: giantpipe against the plain model and its peers.

    python benchmarks/engine_cpu.py            # full run: ~5-10 min on 2 cores
    python benchmarks/engine_cpu.py --quick    # seconds; what the test suite runs

Model: an 8-block MLP (Linear 1024 + ReLU per block), batch 512, K=2 stages on two CPU stand-in
devices, recompute 'never', M in {1, 2, 4, 8, 16}. One training step = forward + backward.
Side by side, in interleaved rounds (this machine is shared and noisy; we report the median):

    plain         the un-pipelined model on one core
    plain-mb      the same, micro-batch by micro-batch (gradient accumulation) on one core
    gp-forward    giantpipe, torchgpipe's door: loss = f(pipe(x)); loss.backward()
    gp-step       giantpipe, step door: pipe.train_step(x, y, loss_fn)
    torchgpipe    torchgpipe 0.0.7, devices ['cpu', 'cpu'] (if installed)
    pippy-gpipe   torch.distributed.pipelining ScheduleGPipe, 2 gloo processes (1 core each)
    pippy-1f1b    torch.distributed.pipelining Schedule1F1B, same

The bound for a K=2 pipeline is 2 x (plain-mb throughput on one core) x M / (M + 1): two cores,
each as efficient as one core on micro-batches of that size, minus the fill-drain bubble.
A second table compares re-materialization 'always' and 'never' on a deeper MLP.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (for tests)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5)")
    parser.add_argument("--chunks", type=int, nargs="+", help="values of M (default 1 2 4 8 16)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.multiprocessing as mp
from torch import nn

from giantpipe import GPipe
from giantpipe.testing import free_port


@dataclass(frozen=True)
class Setup:
    width: int
    blocks: int
    batch: int
    chunks: tuple[int, ...]
    rounds: int
    steps: int
    deep_blocks: int


FULL = Setup(
    width=1024, blocks=8, batch=512, chunks=(1, 2, 4, 8, 16), rounds=5, steps=3, deep_blocks=32
)
QUICK = Setup(width=64, blocks=4, batch=32, chunks=(1, 4), rounds=1, steps=1, deep_blocks=8)


def mlp(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]
    )


def timed(step: Callable[[], None], steps: int) -> float:
    """Seconds per step: a full garbage collection, one warm-up, then the mean of ``steps``
    steps."""
    # Building models leaves a full (generation 2) collection due; left to chance it lands in
    # whichever method is timed next. In a 2-process peers round it took 193 ms inside one
    # GPipe step of rank 0, stalling rank 1 as long: that was "distributed GPipe is slow".
    gc.collect()
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int) -> Callable:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
            (nn.functional.mse_loss(model(xc), yc) / chunks).backward()

    return step


def gpipe_steps(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, chunks: int, recompute: str = "never"
) -> tuple[GPipe, Callable, Callable]:
    half = len(model) // 2
    pipe = GPipe(
        model,
        [half, len(model) - half],
        devices=["cpu", "cpu"],
        chunks=chunks,
        recompute=recompute,
    )

    def forward_door() -> None:
        pipe.zero_grad(set_to_none=True)
        nn.functional.mse_loss(pipe(x), y).backward()

    def step_door() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.mse_loss)

    return pipe, forward_door, step_door


def torchgpipe_step(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, chunks: int
) -> Callable | None:
    try:
        import torchgpipe
    except ImportError:
        return None
    half = len(model) // 2
    pipe = torchgpipe.GPipe(
        model, [half, len(model) - half], devices=["cpu", "cpu"], chunks=chunks, recompute="never"
    )

    def step() -> None:
        pipe.zero_grad(set_to_none=True)
        nn.functional.mse_loss(pipe(x), y).backward()

    return step


# ---- torch.distributed.pipelining in two gloo processes ---------------------------------------


def _pippy_worker(rank: int, port: int, setup: Setup, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = mlp(setup.width, setup.blocks)
    half = len(model) // 2
    part = model[:half] if rank == 0 else model[half:]
    x = torch.randn(setup.batch, setup.width)
    y = torch.randn(setup.batch, setup.width)
    results = []
    for name, cls in (("pippy-gpipe", ScheduleGPipe), ("pippy-1f1b", Schedule1F1B)):
        for chunks in setup.chunks:
            if cls is Schedule1F1B and chunks < 2:
                continue  # 1F1B needs at least as many micro-batches as stages
            stage = PipelineStage(part, rank, 2, torch.device("cpu"))
            schedule = cls(stage, n_microbatches=chunks, loss_fn=nn.functional.mse_loss)

            def step(schedule=schedule) -> None:  # type: ignore[no-untyped-def]
                part.zero_grad(set_to_none=True)
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=[])

            dist.barrier()
            seconds = timed(step, setup.steps)
            dist.barrier()
            results.append((name, chunks, seconds))
    if rank == 1:
        torch.save(results, out_path)
    dist.destroy_process_group()


def pippy_round(setup: Setup) -> dict[tuple[str, int], float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pippy.pt")
        mp.start_processes(_pippy_worker, args=(port, setup, out), nprocs=2, start_method="spawn")
        return {(name, m): sec for name, m, sec in torch.load(out)}


# ---- the rounds -----------------------------------------------------------------------------


def one_round(setup: Setup, bubbles: dict) -> dict[tuple[str, int], float]:
    x = torch.randn(setup.batch, setup.width)
    y = torch.randn(setup.batch, setup.width)
    base = mlp(setup.width, setup.blocks)
    seconds: dict[tuple[str, int], float] = {}
    torch.set_num_threads(1)  # the plain baselines run on one core
    seconds[("plain", 0)] = timed(plain_step(copy.deepcopy(base), x, y, 1), setup.steps)
    for m in setup.chunks:
        seconds[("plain-mb", m)] = timed(plain_step(copy.deepcopy(base), x, y, m), setup.steps)
    torch.set_num_threads(2)  # pipelines get both cores (giantpipe gives each stage one)
    for m in setup.chunks:
        pipe, forward_door, step_door = gpipe_steps(copy.deepcopy(base), x, y, m)
        seconds[("gp-forward", m)] = timed(forward_door, setup.steps)
        seconds[("gp-step", m)] = timed(step_door, setup.steps)
        bubbles.setdefault(m, []).append(pipe.last_stats.bubble)
        tg = torchgpipe_step(copy.deepcopy(base), x, y, m)
        if tg is not None:
            seconds[("torchgpipe", m)] = timed(tg, setup.steps)
    seconds.update(pippy_round(setup))
    return seconds


def throughput_table(setup: Setup) -> str:
    rounds, bubbles = [], {}
    for r in range(setup.rounds):
        print(f"round {r + 1}/{setup.rounds} ...", file=sys.stderr, flush=True)
        rounds.append(one_round(setup, bubbles))
    median = {k: statistics.median(rd[k] for rd in rounds if k in rd) for k in rounds[0]}
    rate = {k: setup.batch / v for k, v in median.items()}
    methods = ["gp-forward", "gp-step", "torchgpipe", "pippy-gpipe", "pippy-1f1b"]
    lines = [
        f"MLP {setup.blocks} x Linear({setup.width}) + ReLU, batch {setup.batch}, K=2 CPU "
        f"stand-ins, recompute never; median of {setup.rounds} rounds; samples/s "
        "(fraction of bound)",
        "",
        "| M | plain 1 core | plain-mb 1 core | bound | "
        + " | ".join(methods)
        + " | measured bubble | (K-1)/(M+K-1) |",
        "|---" * (len(methods) + 6) + "|",
    ]
    for m in setup.chunks:
        bound = 2 * rate[("plain-mb", m)] * m / (m + 1)
        cells = []
        for name in methods:
            r = rate.get((name, m))
            cells.append("-" if r is None else f"{r:.0f} ({r / bound:.2f})")
        lines.append(
            f"| {m} | {rate[('plain', 0)]:.0f} | {rate[('plain-mb', m)]:.0f} | {bound:.0f} | "
            + " | ".join(cells)
            + f" | {statistics.median(bubbles[m]):.3f} | {1 / (m + 1):.3f} |"
        )
    return "\n".join(lines)


def memory_table(setup: Setup) -> str:
    torch.set_num_threads(2)
    base = mlp(setup.width, setup.deep_blocks)
    x = torch.randn(setup.batch, setup.width)
    y = torch.randn(setup.batch, setup.width)
    chunks = setup.chunks[-1]
    rows = {}
    for mode in ("never", "always"):
        times, peaks = [], []
        for _ in range(max(setup.rounds, 1)):
            pipe, _, step_door = gpipe_steps(copy.deepcopy(base), x, y, chunks, recompute=mode)
            times.append(timed(step_door, setup.steps))
            peaks.append(max(pipe.last_stats.peak_memory_bytes))
        rows[mode] = (statistics.median(times), max(peaks))
    never_t, never_p = rows["never"]
    lines = [
        f"MLP {setup.deep_blocks} x Linear({setup.width}) + ReLU, batch {setup.batch}, K=2, "
        f"M={chunks}; peak = activation bytes saved for backward on the busiest stage",
        "",
        "| recompute | step time (s) | peak activation memory (MiB) | time vs never | "
        "memory vs never |",
        "|---|---|---|---|---|",
    ]
    for mode, (t, p) in rows.items():
        lines.append(
            f"| {mode} | {t:.3f} | {p / 2**20:.1f} | {t / never_t:.2f} | {p / never_p:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse()
    setup = QUICK if args.quick else FULL
    if args.rounds or args.chunks:
        setup = replace(
            setup, rounds=args.rounds or setup.rounds, chunks=tuple(args.chunks or setup.chunks)
        )
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print(throughput_table(setup))
    print()
    print(memory_table(setup))


if __name__ == "__main__":
    main()
