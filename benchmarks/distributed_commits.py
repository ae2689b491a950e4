"""Two revisions of the distributed executor and torch.distributed.pipelining, step by step in the
same two processes: is giantpipe's standing against pippy any lower than it was?

    python benchmarks/distributed_commits.py --base e1c807e             # ~5 min a round, 2 cores
    python benchmarks/distributed_commits.py --base e1c807e --chunks 4 8 --rounds 7
    python benchmarks/distributed_commits.py --base e1c807e --quick     # tiny, one round

The base revision is checked out into a temporary git worktree and its ``src/giantpipe`` copied
as the package ``giantpipe_base`` (every ``giantpipe`` import renamed), so that one process
holds both. Every round starts a fresh pair of gloo processes of one core each which, for each
M, build every schedule that runs on two workers at both revisions (``base-<schedule>``,
``head-<schedule>``) and pippy's schedules, and time them one step at a time in turn
(distributed_cpu.py's method, models and round robin): a load drift of this shared machine hits
all alike. Tables: samples/s (median of rounds), and per round then median over rounds, head /
base of each schedule and each revision's best schedule against pippy's best.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from commits import REPO, checkout  # torch-free; puts the checkout's src/ and models/ on sys.path

MODELS = ("ffn", "mlp")  # the keys of distributed_cpu.FULL and QUICK (that module imports torch)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, nargs="+", help="the Ms to run (default 4 8)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["mlp"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.multiprocessing as mp
from distributed_cpu import FULL, QUICK, Setup, giantpipe_steps, pippy_steps, round_robin

Seconds = dict[tuple[str, int], float]  # (method, M) -> seconds per step, the slower rank's


def renamed_copy(tree: Path, into: Path) -> Path:
    """``tree``'s src/giantpipe as the package giantpipe_base under ``into`` (returned, for
    sys.path): every import of giantpipe, absolute or named in a string, renamed."""
    target = into / "giantpipe_base"
    shutil.copytree(tree / "src" / "giantpipe", target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bgiantpipe(?=[.\s])", "giantpipe_base", text))
    return into


def _worker(rank: int, port: int, setup: Setup, flip: bool, base: str, out: str) -> None:
    import torch.distributed as dist

    from giantpipe.testing import rank_env

    sys.path.insert(0, base)
    old = importlib.import_module("giantpipe_base.engine.distributed.pipe").DistributedPipe
    torch.set_num_threads(1)
    os.environ.update(rank_env(rank, 2, port))
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    x, y = setup.data()
    results = {}
    for chunks in setup.chunks:
        before = giantpipe_steps(setup, chunks, x, y, old, "base-")
        after = giantpipe_steps(setup, chunks, x, y, prefix="head-")
        # base and head of each schedule side by side, then pippy's
        ours = [m for pair in zip(before.items(), after.items()) for m in pair]
        methods = [*ours, *pippy_steps(setup, chunks, rank, x, y).items()]
        medians = round_robin(methods[::-1] if flip else methods, setup.steps)
        results.update({(name, chunks): s for name, s in medians.items()})
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def one_round(setup: Setup, flip: bool, base: Path) -> Seconds:
    from giantpipe.testing import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        args = (free_port(), setup, flip, str(base), out)
        mp.start_processes(_worker, args=args, nprocs=2, start_method="spawn")
        a, b = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    return {key: max(a[key], b[key]) for key in a}


def ratios(seconds: Seconds, m: int) -> dict[str, float]:
    """One round's ratios at M=``m``: head / base per schedule, each revision's best against
    pippy's best (samples/s)."""
    rate = {name: 1.0 / s for (name, mm), s in seconds.items() if mm == m}
    best = {side: max(r for n, r in rate.items() if n.startswith(side)) for side in
            ("base-", "head-", "pippy-")}  # fmt: skip
    found = {f"head / base {n[5:]}": rate[n] / rate["base-" + n[5:]] for n in rate if
             n.startswith("head-")}  # fmt: skip
    found["base best / pippy best"] = best["base-"] / best["pippy-"]
    found["head best / pippy best"] = best["head-"] / best["pippy-"]
    return found


def main() -> None:
    args = parse()
    setups = [(QUICK if args.quick else FULL)[name] for name in args.models]
    setups = [replace(s, rounds=1 if args.quick else args.rounds) for s in setups]
    if args.chunks or not args.quick:
        setups = [replace(s, chunks=tuple(args.chunks or (4, 8))) for s in setups]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start "
          f"{os.getloadavg()[0]:.2f}; base {args.base}, head this checkout")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tree = checkout(args.base, Path(tmp))
        try:
            base = renamed_copy(tree, Path(tmp) / "packages")
            for setup in setups:
                rounds = []
                for r in range(setup.rounds):
                    print(f"{setup.model} round {r + 1}/{setup.rounds} ...", file=sys.stderr,
                          flush=True)  # fmt: skip
                    rounds.append(one_round(setup, flip=r % 2 == 1, base=base))
                print(f"\n{tables(setup, rounds)}\n\nload average now {os.getloadavg()[0]:.2f}",
                      flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)])


def tables(setup: Setup, rounds: list[Seconds]) -> str:
    methods = sorted({name for rd in rounds for name, _ in rd})
    lines = [
        f"{setup.label()}, K=2 gloo processes x 1 thread; samples/s, median of {len(rounds)} "
        "rounds",
        "",
        "| M | " + " | ".join(methods) + " |",
        "|---" * (len(methods) + 1) + "|",
    ]
    for m in setup.chunks:
        cells = [
            f"{statistics.median(setup.batch / rd[(n, m)] for rd in rounds):.0f}"
            if (n, m) in rounds[0] else "-"
            for n in methods
        ]  # fmt: skip
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Per round, then the median over rounds (and the rounds' values):", ""]
    lines += ["| M | ratio | median | rounds |", "|---|---|---|---|"]
    for m in setup.chunks:
        per = [ratios(rd, m) for rd in rounds]
        for name in per[0]:
            values = [p[name] for p in per]
            shown = ", ".join(f"{v:.2f}" for v in values)
            lines.append(f"| {m} | {name} | {statistics.median(values):.3f} | {shown} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
