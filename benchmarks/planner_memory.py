"""Peak host memory and time of ``pipeline.plan=auto`` on a model larger than the host: built on
meta and measured a layer at a time, against the whole model built first (what planning took
before, and still takes for a model with real parameters).

    python benchmarks/planner_memory.py                  # 26 GiB on meta (this host: 24 GiB)
    python benchmarks/planner_memory.py --gib 2 --whole  # also the whole model, side by side
    python benchmarks/planner_memory.py --gib 2 --whole --checkout /work/main   # code before
    python benchmarks/planner_memory.py --quick          # 1 GiB on meta, for the tests
    python benchmarks/planner_memory.py --gib 2 --whole --limit-gib 1   # the kernel's limit

Each row is one fresh process (imports, the model built, plan_pipeline on two CPU stand-ins,
a batch of ``--batch`` samples): the model is a stack of Linear(width, width) whose fp32 parameters
total ``--gib``; the process's peak resident memory (VmHWM) is read at the end, less its
resident memory before the model was built. ``--checkout DIR`` plans the whole model with
another checkout's code (its src/ first on the path). ``--limit-gib`` lets each process grow
its data segment by at most that much after its imports (``RLIMIT_DATA``, which torch's
allocations count against): a row that needs more says so instead of its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing
GIB = 2**30


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(
    width: int, depth: int, path: str, batch: int = 1, limit_gib: float | None = None
) -> dict[str, float]:
    """Runs in a fresh process: builds the model (``path``: on meta, or whole) and plans it,
    its data segment allowed to grow by ``limit_gib`` at most (None: unlimited)."""
    import torch
    from torch import nn

    from giantpipe.config import ExperimentConfig, LoggerConfig, PipelineConfig, TrainerConfig
    from giantpipe.data.options import SyntheticDataConfig
    from giantpipe.engine.meta import build_on_meta, seeded_init
    from giantpipe.runner.planning import plan_pipeline
    from models.options import MlpModelConfig

    torch.manual_seed(0)
    start = _status("VmRSS")
    if limit_gib is not None:
        limit = _status("VmData") + int(limit_gib * GIB)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    def build() -> nn.Sequential:
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    built = time.perf_counter()
    model = build_on_meta(build) if path == "meta" else build()
    built = time.perf_counter() - built
    pipeline = PipelineConfig(devices="cpu", num_devices=2, plan="auto", memory_budget_gib=1e4)
    cfg = ExperimentConfig(
        name="planner_memory",
        model=MlpModelConfig(),
        data=SyntheticDataConfig(),
        pipeline=pipeline,
        trainer=TrainerConfig(),
        logger=LoggerConfig(progress="none"),
    )
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    extra = {"init": seeded_init(0)} if path == "meta" else {}
    planning = time.perf_counter()
    spec, _ = plan_pipeline(cfg, model, ["cpu", "cpu"], x, y, nn.functional.mse_loss, **extra)
    planning = time.perf_counter() - planning
    return {
        "model_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / GIB,
        "build_s": built,
        "plan_s": planning,
        "peak_gib": (_status("VmHWM") - start) / GIB,
        "balance": list(spec.balance),
    }


def run(
    width: int,
    depth: int,
    path: str,
    src: Path | None = None,
    batch: int = 1,
    limit_gib: float | None = None,
) -> dict[str, Any]:
    """One row: :func:`child` in a fresh process, importing giantpipe from ``src`` (another
    checkout's) or, by default, as this process does; ``{"out_of_memory": True}`` when it
    needed more than ``limit_gib``."""
    first = [str(p) for p in (src, ROOT) if p is not None]
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if src is None:  # a checkout run as documented, not installed: its own src/
        first[:0] = [str(ROOT / "src")] if (ROOT / "src").is_dir() else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(first + inherited), OMP_NUM_THREADS="2")
    code = (
        "import json; from benchmarks.planner_memory import child; "
        f"print(json.dumps(child({width}, {depth}, {path!r}, {batch}, {limit_gib!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 and limit_gib is not None and _out_of_memory(done.stderr):
        return {"out_of_memory": True}
    if done.returncode != 0:
        raise SystemExit(f"{path} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _out_of_memory(stderr: str) -> bool:
    """Whether a child failed for want of memory (torch's allocator, or Python's)."""
    return "can't allocate memory" in stderr or "MemoryError" in stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--gib", type=float, default=26.0, help="the model's fp32 parameters, GiB")
    p.add_argument("--width", type=int, default=8192, help="each Linear(width, width)")
    p.add_argument("--whole", action="store_true", help="also plan the whole model (must fit)")
    p.add_argument("--checkout", type=Path, help="plan the whole model with this checkout too")
    p.add_argument("--batch", type=int, default=1, help="samples (M: its divisors)")
    p.add_argument("--limit-gib", type=float, help="the most each process may grow, GiB")
    p.add_argument("--quick", action="store_true", help="1 GiB of Linear(4096)")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.width = 1.0, 4096
    depth = max(2, round(args.gib * GIB / (4 * (args.width**2 + args.width))))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    load = os.getloadavg()[0]
    print(
        f"{depth} x Linear({args.width}, {args.width}), plan_pipeline on 2 CPU stand-ins, "
        f"batch {args.batch}; host {ram:.1f} GiB, load {load:.1f} at start"
        + (f"; each process may grow by {args.limit_gib:g} GiB" if args.limit_gib else "")
    )
    rows: list[tuple[str, str, Path | None]] = [("meta, a layer at a time", "meta", None)]
    if args.whole:
        rows.append(("whole model", "whole", None))
    if args.checkout:
        rows.append((f"whole model ({args.checkout})", "whole", args.checkout / "src"))
    print("\n| planning | model GiB | peak RSS growth GiB | build s | plan s | balance |")
    print("|---|---|---|---|---|---|")
    for name, path, src in rows:
        r = run(args.width, depth, path, src, args.batch, args.limit_gib)
        if r.get("out_of_memory"):
            print(f"| {name} | {args.gib:.2f} | over the limit | | | out of memory |", flush=True)
            continue
        print(
            f"| {name} | {r['model_gib']:.2f} | {r['peak_gib']:.2f} | {r['build_s']:.1f} "
            f"| {r['plan_s']:.1f} | {r['balance']} |",
            flush=True,
        )
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
