"""Is ``balance_by_time`` the same run after run on a busy machine?

    python benchmarks/balance_stability.py            # 5 runs at a load of about 8: ~1-3 min
    python benchmarks/balance_stability.py --quick    # 2 runs, seconds

Busy-loop processes bring the machine's load to ``--load`` (fewer when other work already
loads it; the load seen is printed), then the same balance is computed ``--runs`` times on the
same model and micro-batch, two ways:

    before   the median of 3 timed runs per layer, balanced as they come (the old behaviour)
    now      balance_by_time: the median of 5, and when a layer's runs spread more than
             MAX_SPREAD, a TimingNoise warning and the FLOPs balance instead

The model is the MLP of ``recipe=mlp_quickstart`` (8 layers, two of them four times wider), on
one micro-batch of 16, cut into 2 stages, as ``pipeline.balance=time`` does.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--load", type=float, default=8.0, help="1-minute load to bring the machine to")
    p.add_argument("--quick", action="store_true", help="2 runs at a load of 2")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
from torch import nn

from giantpipe.perf.balance import balance_by_time, solve_balance, time_layers  # noqa: E402
from giantpipe.perf.stage_profile import TimingNoise  # noqa: E402


def model() -> nn.Sequential:
    torch.manual_seed(0)
    widths = [64, 256, 256, 1024, 1024, 256, 256, 64]
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers.append(nn.Sequential(nn.Linear(a, b), nn.LayerNorm(b), nn.ReLU()))
    layers.append(nn.Linear(64, 10))
    return nn.Sequential(*layers)


def _spin(stop: mp.synchronize.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


@contextmanager
def busy(load: float) -> Iterator[int]:
    """Busy-loop processes up to a 1-minute load of ``load``; yields how many were started."""
    count = max(0, round(load - os.getloadavg()[0]))
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield count
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()


def before(net: nn.Sequential, x: torch.Tensor, parts: int) -> list[int]:
    samples = time_layers(net, x, torch.device("cpu"), repeats=3)
    return solve_balance([statistics.median(s) for s in samples], parts)


def now(net: nn.Sequential, x: torch.Tensor, parts: int) -> tuple[list[int], bool]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TimingNoise)
        balance = balance_by_time(parts, net, x)
    return balance, any(issubclass(w.category, TimingNoise) for w in caught)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    runs, load = (2, 2.0) if args.quick else (args.runs, args.load)
    net, x = model(), torch.randn(16, 64)
    torch.set_num_threads(1)  # as each of K=2 CPU stand-ins on 2 cores
    rows = []
    with busy(load) as started:
        time.sleep(0 if args.quick else 20)  # let the load average climb
        for run in range(runs):
            old = before(net, x, 2)
            new, fell_back = now(net, x, 2)
            rows.append((run + 1, os.getloadavg()[0], old, new, fell_back))
    print(f"{started} busy-loop processes started (target load {load:g}, {os.cpu_count()} cores)")
    print("| run | load | before (median of 3) | now (balance_by_time) | fell back to FLOPs |")
    print("|---|---|---|---|---|")
    for run, seen, old, new, fell_back in rows:
        print(f"| {run} | {seen:.1f} | {old} | {new} | {'yes' if fell_back else 'no'} |")
    distinct_old = len({tuple(r[2]) for r in rows})
    distinct_new = len({tuple(r[3]) for r in rows})
    print(f"\ndistinct balances in {runs} runs: before {distinct_old}, now {distinct_new}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
