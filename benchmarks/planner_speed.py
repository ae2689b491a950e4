"""How long the planner's README command takes, and whether it answers the same every time.

    python benchmarks/planner_speed.py            # the README command, median of 3: ~1-2 min
    python benchmarks/planner_speed.py --quick    # a small AmoebaNet, seconds

Each run is the whole command in a fresh process (``python recipes/plan_pipeline.py ...``:
imports, the model measured on the meta device, the search), timed wall-clock; the printed
table (everything after the header line, which holds the time) must be the same in every run.
``--checkout DIR`` times another checkout's recipe the same way (e.g. the code before the
search was bounded, for a before/after figure).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

README = (
    "--model amoebanet-d --layers 18 --filters 256 --devices 8 --memory-gib 16 --batch 512 "
    "--peak-tflops 125 --bandwidth-gbps 50"
)
QUICK = "--model amoebanet-d --layers 3 --filters 16 --image-size 64 --devices 2 --memory-gib 1 "
QUICK += "--batch 8"


def run_once(checkout: Path, args: str, timeout: float) -> tuple[float, float, str]:
    """Wall seconds and CPU seconds (user + system: what a busy machine does not inflate as
    much) of one run, and its table (the output after the header line)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout's own code
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(checkout / "recipes" / "plan_pipeline.py"), *args.split()],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"plan_pipeline.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds, cpu, done.stdout.split("\n", 1)[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--checkout", type=Path, default=ROOT, help="whose recipes/plan_pipeline.py")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--quick", action="store_true", help="a small model, 1 run")
    args = p.parse_args(argv)
    command, runs = (QUICK, 1) if args.quick else (README, args.runs)
    print(f"python recipes/plan_pipeline.py {command}")
    print(f"checkout {args.checkout}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    times, cpus, tables = [], [], set()
    for i in range(runs):
        seconds, cpu, table = run_once(args.checkout, command, args.timeout)
        times.append(seconds)
        cpus.append(cpu)
        tables.add(table)
        load = os.getloadavg()[0]
        print(f"run {i + 1}: {seconds:.1f} s wall, {cpu:.1f} s CPU (load {load:.1f})", flush=True)
    print(
        f"median of {runs}: {statistics.median(times):.1f} s wall, "
        f"{statistics.median(cpus):.1f} s CPU; same table every run: ",
        end="",
    )
    print("yes" if len(tables) == 1 else f"NO ({len(tables)} different)")
    rows = [line for line in next(iter(tables)).splitlines() if line.strip()]
    print("\n".join(rows[:4]))  # the header, and the best two
    return 0 if len(tables) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
