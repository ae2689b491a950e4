"""The replicas' gradient sync at K=2 x R=2 on CPU: the hand-written GradientSync of a checkout
before FSDP2 (``--baseline``) against FSDP2's three sharding modes, side by side in one run.

    git archive 1393856 src | tar -x -C /tmp/base     # the code before, GradientSync and all
    python benchmarks/replica_speed.py --baseline /tmp/base/src        # ~10 min on 2 cores
    python benchmarks/replica_speed.py --baseline /tmp/base/src --quick   # tiny, one round

A method is one world of 4 gloo processes on loopback (K=2 pipeline ranks x R=2 replicas, one
thread each), importing giantpipe from its own source tree: ``gradsync`` the baseline's
(buckets all-reduced from inside the last backward), ``fsdp-none`` / ``fsdp-grads`` /
``fsdp-full`` this checkout's (``replica_sharding=...``). Each builds an MLP (8 x Linear(d) +
ReLU, 4 blocks a stage) under gpipe, 1f1b and zb-h1 (M=4, recompute never) and times whole
training steps as a run takes them: ``train_step``, then AdamW's step and ``zero_grad``; a
step's time is the slowest rank's, after a barrier and a full garbage collection, a warm-up
step first. A round starts every method's world in turn, the order reversed every other round
(the shared machine's load hits all alike); a round's figure is the median of its steps, the
table gives the median over rounds, steps/s and each method's ratio to ``gradsync``, and the
modes' paired ratios to each other (what ``pipeline.replica_sharding``'s default rests on).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The checkout's models/ (as every script); giantpipe comes from each method's src, put first
# by its worker before the import.
sys.path[:0] = [str(ROOT)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--baseline",
        type=Path,
        required=True,
        help="the src/ of a checkout with GradientSync (e.g. git archive 1393856 src)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--rounds", type=int, help="rounds (default 5; --quick 1)")
    args = parser.parse_args(argv)
    found = args.baseline / "giantpipe" / "engine" / "dist" / "gradsync.py"
    if not found.is_file():
        parser.error(f"--baseline: {args.baseline} holds no giantpipe with GradientSync ({found})")
    return args


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.multiprocessing as mp
from torch import nn

METHODS = ("gradsync", "fsdp-none", "fsdp-grads", "fsdp-full")
SCHEDULES = ("gpipe", "1f1b", "zb-h1")


@dataclass(frozen=True)
class Setup:
    width: int
    batch: int
    rounds: int
    steps: int

    def build(self) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            *[m for _ in range(8) for m in (nn.Linear(self.width, self.width), nn.ReLU())]
        )


FULL = Setup(width=512, batch=256, rounds=5, steps=5)
QUICK = Setup(width=32, batch=16, rounds=1, steps=1)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _worker(rank: int, port: int, src: str, method: str, setup: Setup, out: str) -> None:
    sys.path.insert(0, src)  # before giantpipe is imported: the method's own engine
    import torch.distributed as dist

    try:
        from giantpipe.engine.distributed.pipe import DistributedPipe
    except ModuleNotFoundError:  # the baseline, from before engine/dist was renamed
        from giantpipe.engine.dist.pipe import DistributedPipe  # type: ignore[no-redef]

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE="4", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    kwargs = {} if method == "gradsync" else {"replica_sharding": method.split("-")[1]}
    torch.manual_seed(1)
    x, y = torch.randn(setup.batch, setup.width), torch.randn(setup.batch, setup.width)
    half = setup.batch // 2
    times: dict[str, float] = {}
    for schedule in SCHEDULES:
        pipe = DistributedPipe(
            setup.build,
            [8, 8],
            chunks=4,
            recompute="never",
            schedule=schedule,
            timeout=600,
            **kwargs,
        )
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        mine = slice(pipe.replica * half, (pipe.replica + 1) * half)
        inputs = x[mine] if pipe.needs_inputs else None
        targets = y[mine] if pipe.needs_targets else None

        def step(pipe: Any = pipe, opt: Any = opt, xs: Any = inputs, ys: Any = targets) -> float:
            gc.collect()
            dist.barrier()
            start = time.perf_counter()
            pipe.train_step(xs, ys, nn.functional.mse_loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        step()  # warm-up: first steps set up buffers and connections
        mine_s = statistics.median(step() for _ in range(setup.steps))
        slowest = torch.tensor([mine_s], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times[schedule] = float(slowest)
        pipe.release()
    if rank == 0:
        torch.save(times, out)
    dist.barrier()
    dist.destroy_process_group()


def one_world(src: str, method: str, setup: Setup) -> dict[str, float]:
    """Seconds per step of ``method`` under each schedule (the slowest rank's median)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        args = (_port(), src, method, setup, out)
        mp.start_processes(_worker, args=args, nprocs=4, start_method="spawn")
        times: dict[str, float] = torch.load(out)
    return times


def table(setup: Setup, rounds: list[dict[str, dict[str, float]]]) -> str:
    lines = [
        f"MLP 8 x (Linear({setup.width}) + ReLU), 4 a stage; K=2 x R=2 gloo processes x 1 thread, "
        f"batch {setup.batch} (half per replica), M=4, recompute never, AdamW; median of "
        f"{len(rounds)} rounds of {setup.steps} steps; steps/s (ratio to gradsync)",
        "",
        "| schedule | " + " | ".join(METHODS) + " |",
        "|---" * (len(METHODS) + 1) + "|",
    ]
    for schedule in SCHEDULES:
        median = {m: statistics.median(rd[m][schedule] for rd in rounds) for m in METHODS}
        cells = [f"{1 / median[m]:.2f} ({median['gradsync'] / median[m]:.2f})" for m in METHODS]
        lines.append(f"| {schedule} | " + " | ".join(cells) + " |")
    paired = [
        statistics.median(rd["gradsync"][s] / rd[m][s] for rd in rounds)
        for m in METHODS
        for s in SCHEDULES
    ]
    lines += [
        "",
        "Paired (median over rounds of each round's ratio to gradsync), per schedule:",
        "",
        "| method | " + " | ".join(SCHEDULES) + " |",
        "|---" * (len(SCHEDULES) + 1) + "|",
    ]
    for i, m in enumerate(METHODS):
        cells = paired[i * len(SCHEDULES) : (i + 1) * len(SCHEDULES)]
        lines.append(f"| {m} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    lines += [
        "",
        "The sharding modes against each other (median over rounds of each round's ratio: how "
        "many times faster the first runs a step than the second):",
        "",
        "| modes | " + " | ".join(SCHEDULES) + " |",
        "|---" * (len(SCHEDULES) + 1) + "|",
    ]
    for fast, slow in (("fsdp-grads", "fsdp-full"), ("fsdp-none", "fsdp-grads")):
        cells = [statistics.median(rd[slow][s] / rd[fast][s] for rd in rounds) for s in SCHEDULES]
        lines.append(f"| {fast} / {slow} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse()
    setup = QUICK if args.quick else FULL
    if args.rounds:
        setup = replace(setup, rounds=args.rounds)
    sources = {m: str(args.baseline if m == "gradsync" else ROOT / "src") for m in METHODS}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    rounds = []
    for r in range(setup.rounds):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        result = {}
        for method in order:
            print(f"round {r + 1}/{setup.rounds}: {method} ...", file=sys.stderr, flush=True)
            result[method] = one_world(sources[method], method, setup)
        rounds.append(result)
    print(f"\n{table(setup, rounds)}\n\nload average now {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
