"""What the pre-flight memory check costs the default job: ``python train.py`` with
``trainer.memory_check=true`` and ``=false``, run for run, median of the rounds.

    python benchmarks/preflight_cost.py                       # the default job, 3 rounds
    python benchmarks/preflight_cost.py --rounds 5 trainer.max_steps=10 trainer.eval_every=0

Each run is a fresh process in a scratch directory, timed from start to exit (wall clock) with
the CPU seconds it used (user + system) beside it; the two settings take turns within each round,
so both see the same load, and each round's difference (check on - off) is taken within the
round. Extra arguments are overrides given to both. The check's cost does not depend on the
number of steps, so a shortened job measures the same difference with less noise.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(overrides: list[str], cwd: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``python train.py OVERRIDES``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(
            f"train.py {' '.join(overrides)} exited {result.returncode}: {result.stderr}"
        )
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="given to both settings")
    options = parser.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    runs: dict[str, list[tuple[float, float]]] = {"true": [], "false": []}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(options.rounds):
            order = ("true", "false") if index % 2 == 0 else ("false", "true")
            for check in order:
                runs[check].append(
                    timed([*options.overrides, f"trainer.memory_check={check}"], Path(scratch))
                )
            on, off = runs["true"][-1], runs["false"][-1]
            print(
                f"round {index + 1}: on {on[0]:.1f} s ({on[1]:.1f} CPU s), "
                f"off {off[0]:.1f} s ({off[1]:.1f} CPU s)",
                flush=True,
            )
    print(f"\n`python train.py {' '.join(options.overrides)}`, {options.rounds} rounds\n")
    print("| trainer.memory_check | wall s, median | min | max | CPU s, median |")
    print("|---|---|---|---|---|")
    for check, done in runs.items():
        wall, cpu = [w for w, _ in done], [c for _, c in done]
        print(
            f"| {check} | {statistics.median(wall):.1f} | {min(wall):.1f} | {max(wall):.1f} "
            f"| {statistics.median(cpu):.1f} |"
        )
    walls = [a[0] - b[0] for a, b in zip(runs["true"], runs["false"])]
    cpus = [a[1] - b[1] for a, b in zip(runs["true"], runs["false"])]
    print(
        f"\ncheck on - off, median of the rounds' differences: "
        f"{statistics.median(walls):+.2f} s wall, {statistics.median(cpus):+.2f} CPU s"
    )
    print(
        f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main()
