"""Two revisions against torch.distributed.pipelining side by side: did the distributed
executor's standing against pippy fall?

    python benchmarks/distributed_commits.py --base e1c807e                 # ~10 min per round
    python benchmarks/distributed_commits.py --base e1c807e --chunks 4 8 --rounds 5
    python benchmarks/distributed_commits.py --base e1c807e --quick         # seconds

Each round runs ``benchmarks/distributed_cpu.py --rounds 1`` of the base revision (a temporary
git worktree) and of this checkout, one after the other (which goes first alternates), each in
a fresh process importing its own tree. Within one run giantpipe's and pippy's steps alternate
on the same two processes, so a round's ratio giantpipe / pippy is measured under one load; the
table gives, per revision, the median over rounds of that ratio (best schedule against best
schedule, and schedule against the same schedule), and head / base of those medians.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from commits import REPO, checkout

Rates = dict[tuple[str, int], float]  # (method, M) -> samples/s
PAIRS = [("gpipe", "gpipe"), ("1f1b", "1f1b"), ("interleaved", "interleaved"), ("zb-v", "zbv")]


def parse_rates(text: str) -> Rates:
    """Samples/s of every method at every M, from a printed run's first table.

    >>> parse_rates("\\n".join([
    ...     "| M | plain-mb 1 core | bound | gp-dist-1f1b | pippy-1f1b |",
    ...     "|---|---|---|---|---|",
    ...     "| 4 | 620 | 992 | 933 (0.94) | - |",
    ... ]))
    {('gp-dist-1f1b', 4): 933.0}
    """
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("| M | plain-mb 1 core |"))
    methods = [c.strip() for c in lines[top].strip("|").split("|")[3:]]
    rates: Rates = {}
    for row in lines[top + 2 :]:
        if not row.startswith("| "):
            break
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name, cell in zip(methods, cells[3:]):
            found = re.match(r"([\d.]+) \(", cell)
            if found:
                rates[(name, int(cells[0]))] = float(found.group(1))
    return rates


def one_run(tree: Path, args: list[str]) -> Rates:
    """One round of ``tree``'s distributed_cpu.py, in a fresh process importing that tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, str(tree / "benchmarks" / "distributed_cpu.py"), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: distributed_cpu.py failed:\n{done.stderr[-3000:]}")
    return parse_rates(done.stdout)


def ratios(rates: Rates, m: int) -> dict[str, float]:
    """giantpipe / pippy at M=``m``: best against best, and each schedule against its own."""
    at = {name: r for (name, mm), r in rates.items() if mm == m}
    ours = [r for name, r in at.items() if name.startswith("gp-dist-")]
    theirs = [r for name, r in at.items() if name.startswith("pippy-")]
    out = {"best / best": max(ours) / max(theirs)}
    for gp, pp in PAIRS:
        if f"gp-dist-{gp}" in at and f"pippy-{pp}" in at:
            out[f"{gp} / {gp}"] = at[f"gp-dist-{gp}"] / at[f"pippy-{pp}"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=["mlp", "ffn"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    run_args = ["--rounds", "1", "--chunks", *map(str, args.chunks)]
    run_args += ["--quick"] if args.quick else []
    print(f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    found: dict[tuple[str, str, int, str], list[float]] = {}  # (model, tree, M, pair) -> ratios
    with tempfile.TemporaryDirectory() as tmp:
        base = checkout(args.base, Path(tmp))
        try:
            for model in args.models:
                for r in range(rounds):
                    trees = [("base", base), ("head", REPO)][:: 1 if r % 2 == 0 else -1]
                    for name, tree in trees:
                        rates = one_run(tree, [*run_args, "--models", model])
                        for m in args.chunks:
                            for pair, value in ratios(rates, m).items():
                                found.setdefault((model, name, m, pair), []).append(value)
                        best = {m: ratios(rates, m)["best / best"] for m in args.chunks}
                        print(f"{model} round {r + 1} {name}: best/best {best}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)])
    print(f"\nbase {args.base} vs head (this checkout): giantpipe / pippy samples/s, median of "
          f"{rounds} rounds")  # fmt: skip
    print(
        "\n| model | M | giantpipe / pippy | base | head | head / base |\n|---|---|---|---|---|---|"
    )
    for (model, name, m, pair), values in found.items():
        if name != "base":
            continue
        b, h = statistics.median(values), statistics.median(found[(model, "head", m, pair)])
        print(f"| {model} | {m} | {pair} | {b:.3f} | {h:.3f} | {h / b:.3f} |")
    print(f"\nload average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
