"""Two revisions of giantpipe side by side: is the engine any slower than it was?

    python benchmarks/commits.py --base 1841faa            # base vs this checkout, ~5 min
    python benchmarks/commits.py --base 1841faa --quick    # seconds

The base revision is checked out into a temporary git worktree; each measurement runs in a
fresh Python process whose ``PYTHONPATH`` points at one tree or the other, base and head
alternating round by round (this machine is shared and noisy: medians of the rounds, and the
ratio head / base within each round). Two measurements, the model and sizes of
``benchmarks/engine_cpu.py`` (8 x Linear(1024) + ReLU, batch 512, K=2, checkpoint 'never'):

    local        GPipe.train_step on two CPU stand-ins, M in --chunks
    distributed  DistributedPipe.train_step, two gloo processes of one core each, same M

A revision's engine is imported as it was then (``giantpipe.pipe`` or ``giantpipe.engine``);
only the public API is used: ``GPipe(...)``, ``DistributedPipe(...)``, ``train_step``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]  # run from a checkout without installing

# The measurement, run in a fresh process against one tree (its PYTHONPATH).
PROBE = r"""
import datetime, json, os, sys, tempfile, time
import torch, torch.multiprocessing as mp
from torch import nn

width, blocks, batch, steps, chunks, kind = json.loads(sys.argv[1])

def mlp():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]
    return nn.Sequential(*layers)

def timed(step):
    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps

def local():
    from giantpipe import GPipe
    torch.manual_seed(1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    devices = ["cpu", "cpu"]
    pipe = GPipe(mlp(), [blocks // 2] * 2, devices=devices, chunks=chunks, checkpoint="never")
    def step():
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.mse_loss)
    return timed(step)

def worker(rank, rendezvous, out):
    import torch.distributed as dist
    try:
        from giantpipe.engine.distributed.pipe import DistributedPipe
    except ImportError:
        from giantpipe.pipe.distributed import DistributedPipe
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    # A file rendezvous: no port picked here that another process could take meanwhile.
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2, timeout=timeout
    )
    torch.manual_seed(1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    pipe = DistributedPipe(mlp, [blocks // 2] * 2, chunks=chunks, recompute="never", timeout=120)
    def step():
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None,
                        nn.functional.mse_loss)
    dist.barrier()
    seconds = timed(step)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(seconds))
    if hasattr(pipe, "release"):  # revisions that have it: no request outlives the groups
        pipe.release()
    dist.destroy_process_group()

def distributed():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.start_processes(worker, args=(rendezvous, out), nprocs=2, start_method="spawn")
        return float(open(out).read())

if __name__ == "__main__":
    seconds = local() if kind == "local" else distributed()
    print(json.dumps({"samples_per_s": batch / seconds}))
"""


def measure(tree: Path, kind: str, sizes: tuple[int, int, int, int], chunks: int) -> float:
    """Samples per second of one measurement in a fresh process importing ``tree``."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(PROBE)
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}:{tree}")
    args = json.dumps([*sizes, chunks, kind])
    try:
        done = subprocess.run(
            [sys.executable, script.name, args], env=env, capture_output=True, text=True
        )
    finally:
        os.unlink(script.name)
    if done.returncode != 0:  # say why, not only that the probe failed
        raise RuntimeError(f"{kind} probe of {tree} failed:\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["samples_per_s"])


def checkout(revision: str, where: Path) -> Path:
    """The base revision as a detached git worktree under ``where``."""
    tree = where / "base"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), revision],
        check=True,
    )
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, nargs="+", default=[8])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    args = parser.parse_args(argv)
    sizes = (64, 4, 32, 1) if args.quick else (1024, 8, 512, 3)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        base = checkout(args.base, Path(tmp))
        try:
            rows = compare(base, REPO, sizes, args.chunks, rounds)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)])
    print(f"base {args.base} vs head (this checkout); samples/s, median of {rounds} rounds")
    print("| measurement | M | base | head | head / base (median of rounds) |")
    print("|---|---|---|---|---|")
    for (kind, m), (b, h) in rows.items():
        ratio = statistics.median(y / x for x, y in zip(b, h))
        print(
            f"| {kind} | {m} | {statistics.median(b):.0f} | {statistics.median(h):.0f} "
            f"| {ratio:.3f} |"
        )
    return 0


def compare(
    base: Path, head: Path, sizes: tuple[int, int, int, int], chunks: list[int], rounds: int
) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """Every measurement of both trees; which goes first alternates from round to round."""
    rows: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for r in range(rounds):
        for kind in ("local", "distributed"):
            for m in chunks:
                b, h = rows.setdefault((kind, m), ([], []))
                for tree, into in [(base, b), (head, h)][:: 1 if r % 2 == 0 else -1]:
                    into.append(measure(tree, kind, sizes, m))
                print(
                    f"round {r + 1}: {kind} M={m}: base {b[-1]:.0f}, head {h[-1]:.0f}", flush=True
                )
    return rows


if __name__ == "__main__":
    sys.exit(main())
