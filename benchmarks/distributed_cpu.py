"""Distributed executor benchmark: 2 gloo processes x 1 core, against torch.distributed.pipelining.

    python benchmarks/distributed_cpu.py            # full run: ~5-8 min on 2 cores
    python benchmarks/distributed_cpu.py --quick    # seconds

Same model and method as benchmarks/engine_cpu.py (whose functions this imports): an 8-block
MLP (Linear 1024 + ReLU per block), batch 512, K=2 stages, checkpoint 'never', M in
{1, 2, 4, 8, 16}, one process per stage with ``torch.set_num_threads(1)``. Side by side, in
interleaved rounds (the machine is shared; medians are reported):

    plain-mb        the un-pipelined model micro-batch by micro-batch on one core (the base)
    gp-dist-<name>  giantpipe's DistributedPipe (parameters built on meta, p2p over gloo)
                    under every registered schedule that runs on 2 workers (interleaved: V=2,
                    4 stages of 2 blocks; only where M is a multiple of 2)
    pippy-gpipe     torch.distributed.pipelining ScheduleGPipe, 2 gloo processes
    pippy-1f1b      torch.distributed.pipelining Schedule1F1B, same

The bound for K=2 is 2 x (plain-mb throughput on one core) x M / (M + 1), as in engine_cpu.py.
A second table divides by an in-run bound instead: plain-mb timed on one core inside the
pipeline's own process right before it runs, which moves with the machine's load.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cpu import FULL, QUICK, Setup, mlp, pippy_round, plain_step, timed  # noqa: E402

from giantpipe.engine.dist.pipe import DistributedPipe  # noqa: E402
from giantpipe.engine.schedules import build_schedule, schedule_builders  # noqa: E402


def schedules_for_two_workers(chunks: int) -> list[tuple[str, int]]:
    """Every registered schedule that runs on K=2 workers at this M, with the smallest V."""
    found = []
    for name in sorted(schedule_builders()):
        for v in (1, 2):
            try:
                build_schedule(name, 2, chunks, v)
            except ValueError:
                continue
            found.append((name, v))
            break
    return found


def _giantpipe_worker(rank: int, port: int, setup: Setup, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    torch.manual_seed(1)
    x = torch.randn(setup.batch, setup.width)
    y = torch.randn(setup.batch, setup.width)
    results = []
    for chunks in setup.chunks:
        # The in-run bound: plain-mb on one core of this very process, right before the
        # pipelines (rank 1 idles at the barrier), so that load drifts hit both alike.
        if rank == 0:
            plain = timed(plain_step(mlp(setup.width, setup.blocks), x, y, chunks), setup.steps)
            results.append(("plain-mb-inrun", chunks, plain, 0.0))
        dist.barrier()
        for name, v in schedules_for_two_workers(chunks):
            stages = 2 * v
            pipe = DistributedPipe(
                lambda: mlp(setup.width, setup.blocks),
                [setup.blocks // stages] * stages,
                chunks=chunks,
                checkpoint="never",
                schedule=name,
                virtual_stages=v,
                timeout=120,
            )

            def step(pipe: DistributedPipe = pipe) -> None:
                pipe.zero_grad(set_to_none=True)
                pipe.train_step(
                    x if pipe.needs_inputs else None,
                    y if pipe.needs_targets else None,
                    nn.functional.mse_loss,
                )

            dist.barrier()
            seconds = timed(step, setup.steps)
            stats = pipe.last_stats
            results.append((f"gp-dist-{name}", chunks, seconds, stats.bubble if stats else 0.0))
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def giantpipe_round(setup: Setup) -> tuple[dict[tuple[str, int], float], dict[int, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gp.pt")
        port = _free_port()
        mp.start_processes(
            _giantpipe_worker, args=(port, setup, out), nprocs=2, start_method="spawn"
        )
        rows = torch.load(f"{out}.1") + torch.load(f"{out}.0")
    seconds = {(name, m): sec for name, m, sec, _ in rows}
    bubbles = {m: bubble for name, m, _, bubble in rows if name == "gp-dist-gpipe"}
    return seconds, bubbles


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_round(setup: Setup, bubbles: dict[int, list[float]]) -> dict[tuple[str, int], float]:
    torch.manual_seed(1)
    x = torch.randn(setup.batch, setup.width)
    y = torch.randn(setup.batch, setup.width)
    torch.set_num_threads(1)
    seconds: dict[tuple[str, int], float] = {}
    for m in setup.chunks:
        model = mlp(setup.width, setup.blocks)
        seconds[("plain-mb", m)] = timed(plain_step(model, x, y, m), setup.steps)
    gp, gp_bubbles = giantpipe_round(setup)
    seconds.update(gp)
    for m, b in gp_bubbles.items():
        bubbles.setdefault(m, []).append(b)
    seconds.update(pippy_round(setup))
    return seconds


def table(setup: Setup) -> str:
    rounds: list[dict[tuple[str, int], float]] = []
    bubbles: dict[int, list[float]] = {}
    for r in range(setup.rounds):
        print(f"round {r + 1}/{setup.rounds} ...", file=sys.stderr, flush=True)
        rounds.append(one_round(setup, bubbles))
    keys = {k for rd in rounds for k in rd}
    median = {k: statistics.median(rd[k] for rd in rounds if k in rd) for k in keys}
    rate = {k: setup.batch / v for k, v in median.items()}
    names = sorted({name for name, _ in keys if name.startswith("gp-dist")})
    methods = [*names, "pippy-gpipe", "pippy-1f1b"]
    lines = [
        f"MLP {setup.blocks} x Linear({setup.width}) + ReLU, batch {setup.batch}, K=2 gloo "
        f"processes x 1 thread, checkpoint never; median of {setup.rounds} rounds; samples/s "
        "(fraction of bound)",
        "",
        "| M | plain-mb 1 core | bound | " + " | ".join(methods) + " | gp-dist-gpipe bubble |",
        "|---" * (len(methods) + 4) + "|",
    ]
    for m in setup.chunks:
        bound = 2 * rate[("plain-mb", m)] * m / (m + 1)
        cells = []
        for name in methods:
            r = rate.get((name, m))
            cells.append("-" if r is None else f"{r:.0f} ({r / bound:.2f})")
        bubble = statistics.median(bubbles[m]) if m in bubbles else float("nan")
        lines.append(
            f"| {m} | {rate[('plain-mb', m)]:.0f} | {bound:.0f} | "
            + " | ".join(cells)
            + f" | {bubble:.3f} |"
        )
    lines += ["", *inrun_table(setup, rounds, names)]
    return "\n".join(lines)


def inrun_table(
    setup: Setup, rounds: list[dict[tuple[str, int], float]], names: list[str]
) -> list[str]:
    """Fractions of the in-run bound (plain-mb timed inside the pipeline's own process just
    before it), median over rounds of each round's fraction: steadier on a loaded machine."""
    lines = [
        "Same runs, fraction of the in-run bound (plain-mb on one core of rank 0's process, timed "
        "right before; median of per-round fractions):",
        "",
        "| M | in-run bound | " + " | ".join(names) + " |",
        "|---" * (len(names) + 2) + "|",
    ]
    for m in setup.chunks:
        bounds, cells = [], []
        for rd in rounds:
            if ("plain-mb-inrun", m) in rd:
                bounds.append(2 * setup.batch / rd[("plain-mb-inrun", m)] * m / (m + 1))
        for name in names:
            fractions = [
                setup.batch
                / rd[(name, m)]
                / (2 * setup.batch / rd[("plain-mb-inrun", m)] * m / (m + 1))
                for rd in rounds
                if (name, m) in rd and ("plain-mb-inrun", m) in rd
            ]
            cells.append(f"{statistics.median(fractions):.2f}" if fractions else "-")
        bound = f"{statistics.median(bounds):.0f}" if bounds else "-"
        lines.append(f"| {m} | {bound} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start {load[0]:.2f}")
    print()
    print(table(setup))
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
