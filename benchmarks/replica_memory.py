"""Bytes a rank holds when each stage is spread over R replicas on FSDP2, in each sharding mode.

    python benchmarks/replica_memory.py           # K=2, R = 1, 2, 4 (8 processes): ~2 min
    python benchmarks/replica_memory.py --quick   # a small model, R = 1, 2: seconds

Each world is K=2 pipeline ranks x R replicas, gloo processes on loopback, one thread each. It
builds an MLP (8 x Linear(d, d) + ReLU, 4 layers a stage) as a DistributedPipe with
``replica_sharding`` = full, grads or none (R = 1: nothing to spread, the un-sharded figure),
and takes two AdamW steps (M=4, recompute never). Rank 0 (stage 0 of replica 0; stage 1 holds
as much) measures:

    params, grads, optimizer   after the second optimizer step, gradients kept: each by the
                               storages it lives in (a shard: its own part, FSDP2's padding
                               included), giantpipe.testing.held.training_bytes
    live at rest               every live tensor's storage, once (a walk of the garbage
                               collector's list, as the evaluation-memory test does)
    live in the step           the same walk at the end of the second step's actions, before
                               its reduce (gradients still unsharded), the most of the step's
                               parts (with V = 1, one part). Since full reduces each
                               micro-batch (gpipe, 1f1b), its peak is mid-step, not there:
                               results/build_memory.md measures it

and the table divides each state by the un-sharded one (R = 1). What stays unsharded, and why:
the buffers and each AdamW ``step`` counter (a scalar per parameter), FSDP2's padding of dim 0
to a multiple of R; and, during a step, the stage's gradients (they accumulate unsharded over
the micro-batches and are reduced once) and, with ``grads``, its gathered parameters.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, R = 1, 2")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.multiprocessing as mp
from torch import nn

from giantpipe.testing import free_port, rank_env  # noqa: E402

MODES = ("full", "grads", "none")


@dataclass(frozen=True)
class Setup:
    width: int
    layers: int
    batch: int
    replicas: tuple[int, ...]

    def build(self) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            *[m for _ in range(self.layers) for m in (nn.Linear(self.width, self.width), nn.ReLU())]
        )


FULL = Setup(width=512, layers=8, batch=64, replicas=(1, 2, 4))
QUICK = Setup(width=64, layers=4, batch=16, replicas=(1, 2))


def _worker(rank: int, world: int, port: int, setup: Setup, mode: str, out: str) -> None:
    import torch.distributed as dist

    from giantpipe.engine import executor
    from giantpipe.engine.distributed.pipe import DistributedPipe, end_distributed
    from giantpipe.testing.held import live_bytes, training_bytes

    torch.set_num_threads(1)
    os.environ.update(rank_env(rank, world, port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    stages = 2 * setup.layers
    pipe = DistributedPipe(
        setup.build,
        [stages // 2, stages // 2],
        chunks=4,
        recompute="never",
        timeout=300,
        replica_sharding=mode,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    torch.manual_seed(1)
    x, y = torch.randn(setup.batch, setup.width), torch.randn(setup.batch, setup.width)
    share = setup.batch // pipe.replicas
    x, y = x[pipe.replica * share :][:share], y[pipe.replica * share :][:share]
    in_step: list[int] = []
    real = executor.StepRun.run

    def measured(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        if measure:
            in_step.append(live_bytes())

    executor.StepRun.run = measured  # type: ignore[method-assign]
    for step in range(2):
        measure = step == 1
        opt.zero_grad(set_to_none=True)
        pipe.train_step(
            x if pipe.needs_inputs else None,
            y if pipe.needs_targets else None,
            nn.functional.mse_loss,
        )
        opt.step()
    result = {
        **training_bytes(pipe.parameters(), opt),
        "live": live_bytes(),
        "in_step": max(in_step),
    }
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    pipe.release()
    end_distributed()  # every group freed now, not during the shutdown


def measure(setup: Setup, replicas: int, mode: str) -> dict[str, int]:
    """Rank 0's bytes in a world of K=2 x ``replicas`` ranks, ``mode``'s sharding."""
    world = 2 * replicas
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "held.pt")
        args = (world, free_port(), setup, mode, out)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        result: dict[str, int] = torch.load(out)
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(setup: Setup, rows: list[tuple[int, str, dict[str, int]]]) -> str:
    base = next(r for R, _, r in rows if R == 1)
    state = ("params", "grads", "optimizer")
    base_total = sum(base[k] for k in state)
    lines = [
        f"MLP {setup.layers} x (Linear({setup.width}) + ReLU), K=2 stages of {setup.layers // 2}, "
        "AdamW, M=4; "
        f"rank 0 (stage 0, replica 0), MiB; 'vs R=1': the state over the un-sharded one",
        "",
        "| R | sharding | params | grads | optimizer | state | vs R=1 | live at rest | "
        "live in the step |",
        "|---" * 9 + "|",
    ]
    for replicas, mode, r in rows:
        total = sum(r[k] for k in state)
        lines.append(
            f"| {replicas} | {mode} | {mib(r['params'])} | {mib(r['grads'])} | "
            f"{mib(r['optimizer'])} | {mib(total)} | {total / base_total:.2f} | "
            f"{mib(r['live'])} | {mib(r['in_step'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse()
    setup = QUICK if args.quick else FULL
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    rows = []
    for replicas in setup.replicas:
        for mode in MODES if replicas > 1 else ("(unsharded)",):
            print(f"R={replicas} {mode} ...", file=sys.stderr, flush=True)
            rows.append(
                (replicas, mode, measure(setup, replicas, "none" if replicas == 1 else mode))
            )
    print(f"\n{table(setup, rows)}\n\nload average now {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
