"""What the pre-flight memory check costs the default job: ``python train.py`` with
``trainer.memory_check=true`` and ``=false``, run for run, median of the rounds.

    python benchmarks/preflight_cost.py                       # the default job, 3 rounds
    python benchmarks/preflight_cost.py --rounds 5 trainer.max_steps=10 trainer.eval_every=0
    python benchmarks/preflight_cost.py --in-process --rounds 5    # the check alone, seconds

Each run is a fresh process in a scratch directory, timed from start to exit (wall clock) with
the CPU seconds it used (user + system) beside it; the two settings take turns within each round,
so both see the same load, and each round's difference (check on - off) is taken within the
round. Extra arguments are overrides given to both. The check's cost does not depend on the
number of steps, so a shortened job measures the same difference with less noise.
``--in-process`` times the check alone (wall and CPU seconds of each call), in one process whose
first call has imported what it needs.
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
sys.path[:0] = [str(REPO), str(REPO / "src")]  # run from a checkout without installing


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


def in_process(overrides: list[str], rounds: int) -> None:
    """Wall and CPU seconds of the check alone, ``rounds`` calls after a first one."""
    sys.path[:0] = [str(REPO / "src"), str(REPO)]
    from hydra import compose, initialize_config_dir

    from giantpipe.cli.checks import check_config
    from giantpipe.cli.registration import register_configs
    from giantpipe.runner.build import build_bundle, build_model, worker_devices
    from giantpipe.runner.preflight import check_fit
    from giantpipe.runner.world import World

    register_configs(REPO / "conf")
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = check_config(compose("config", overrides=overrides))
    devices, _ = worker_devices(cfg.pipeline, World())
    bundle = build_bundle(cfg, None)
    times = []
    for _ in range(rounds + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        check_fit(cfg, bundle, devices, World(), lambda: build_model(cfg, bundle))
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    first, rest = times[0], times[1:]
    print(f"\n`check_fit` on `python train.py {' '.join(overrides)}`'s config\n")
    print("| call | wall s | CPU s |")
    print("|---|---|---|")
    print(f"| first (imports) | {first[0]:.2f} | {first[1]:.2f} |")
    walls, cpus = [w for w, _ in rest], [c for _, c in rest]
    print(
        f"| median of {rounds} after it | {statistics.median(walls):.2f} | "
        f"{statistics.median(cpus):.2f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help="time the check alone")
    parser.add_argument("overrides", nargs="*", help="given to both settings")
    options = parser.parse_args(argv)
    if options.in_process:
        print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        in_process(options.overrides, options.rounds)
        print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        return
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
