"""Each process's peak host memory and build time as the runner builds and trains a model, beside
the share of the model it owns (issue 37: no rank ever holds the whole model).

    python benchmarks/build_memory.py             # hidden 2048 and 4096, depth 16: ~30 min, ~7 GB
    python benchmarks/build_memory.py --quick     # hidden 256 and 512: a few minutes
    python benchmarks/build_memory.py --giant 26  # a 7 GB model at K=4: 2 steps, a resume (~17 GB)
    python benchmarks/build_memory.py --giant 8 --hidden 1024   # the same at 34 MB, as a check
    python benchmarks/build_memory.py --root DIR  # another checkout (the code before), same worker
    python benchmarks/build_memory.py --set optim.weight_decay=0   # a Hydra override, every run

Each row is real runs of ``train.py recipe=mlp_quickstart model.hidden=H model.depth=16
optim=sgd trainer.max_steps=2`` (no evaluation between steps, the runner's final one over the
eval set, no save), with the local executor (one process, K CPU stand-ins) or under torchrun
(gloo, K x R processes, ``replica_sharding=full``).
Every process runs ``train.py`` inside this script's worker, which reads from the process itself:

    build s     the wall time of ``build_experiment`` (data, model, spec, pipe, optimizer)
    peak MiB    its ``ru_maxrss`` at the end of the run: the most it ever held
    share MiB   what it owns to train: parameters + gradients + optimizer state, each tensor by
                the storage it lives in (``giantpipe.testing.held.training_bytes``)
    over tiny   its peak minus the peak of the same rank in the same layout with hidden 16
    ratio       over tiny / share (the worst rank): at most 1.15 under torchrun
    built over tiny   its peak when build_experiment returned, minus the tiny run's: what
                building held, against its parameters' share (``params MiB``)

and the table gives, per layout, the ranks' largest build time and peak and the worst rank's
figures (the one whose ratio is the largest).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

HERE = Path(__file__).resolve().parents[1]
MIB = 2**20
TINY = 16
"""The hidden width of the baseline run: what a process holds with (almost) no model."""
LIMIT = 1.15
"""Issue 37's bound: a rank's peak over the tiny run's, in units of its share."""
MMAP_THRESHOLD = 0
"""--mmap-threshold: glibc's fixed mmap threshold for every process (0: glibc's own, which
rises to 32 MiB once such a block is freed, so freed tensors below it stay in the heap and count
in the peak RSS); fixed low, every tensor above it goes back to the system when freed."""


@dataclass(frozen=True)
class Layout:
    executor: str
    k: int
    r: int = 1

    @property
    def processes(self) -> int:
        return self.k * self.r if self.executor == "distributed" else 1

    def overrides(self) -> list[str]:
        shape = [f"pipeline.num_devices={self.k}", "pipeline.devices=cpu", "pipeline.chunks=4"]
        if self.executor == "distributed":
            shape += ["pipeline.executor=distributed", "pipeline.replica_sharding=full"]
        return shape

    def label(self) -> str:
        if self.executor == "local":
            return f"local K={self.k}"
        return f"torchrun K={self.k} x R={self.r}"


LAYOUTS = [
    *(Layout("local", k) for k in (1, 2, 4)),
    *(Layout("distributed", k) for k in (1, 2, 4)),
    *(Layout("distributed", k, 2) for k in (1, 2, 4)),
]
QUICK_LAYOUTS = [Layout("local", 2), Layout("distributed", 2), Layout("distributed", 2, 2)]


def run_args(
    hidden: int, depth: int, run_dir: Path, extra: list[str], steps: int = 2, save: bool = False
) -> list[str]:
    return [
        "recipe=mlp_quickstart",
        f"model.hidden={hidden}",
        f"model.depth={depth}",
        "optim=sgd",
        f"trainer.max_steps={steps}",
        "trainer.eval_every=0",
        f"trainer.save_last={str(save).lower()}",
        "trainer.predict=false",
        "logger.progress=none",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def launch(root: Path, layout: Layout, args: list[str], out: Path) -> list[dict[str, Any]]:
    """One run of ``train.py args`` in ``layout``; each process's figures (rank order)."""
    worker = [str(Path(__file__).resolve()), "--worker", str(out), "--root", str(root), "--"]
    if layout.executor == "distributed":
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={layout.processes}", *worker, *args,
        ]  # fmt: skip
    else:
        command = [sys.executable, *worker, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root / 'src'}:{root}"}
    if MMAP_THRESHOLD:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True)
    figures = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if done.returncode != 0 or len(figures) != layout.processes:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return sorted(figures, key=lambda f: f["rank"])


def worker(out: Path, root: Path, argv: list[str]) -> None:
    """Runs ``train.py argv`` in this process; writes its figures to ``out/rankN.json``."""
    sys.path[:0] = [str(root / "src"), str(root)]
    from giantpipe.runner import run as run_module
    from giantpipe.testing.held import training_bytes

    real = run_module.build_experiment
    seen: dict[str, Any] = {}

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        parts = real(*args, **kwargs)
        seen["build_s"], seen["parts"] = time.perf_counter() - started, parts
        seen["built_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return parts

    run_module.build_experiment = timed
    sys.argv = [str(root / "train.py"), *argv]
    code: Any = 0
    try:
        runpy.run_path(str(root / "train.py"), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    parts = seen["parts"]
    state = training_bytes(parts.pipe.parameters(), parts.optimizer)
    figures = {
        "rank": int(os.environ.get("RANK", "0")),
        "code": code,
        "build_s": seen["build_s"],
        "built_rss": seen["built_rss"],
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "share": sum(state.values()),
        **state,
    }
    (out / f"rank{figures['rank']}.json").write_text(json.dumps(figures))


def measure(
    root: Path, layout: Layout, hidden: int, depth: int, extra: list[str]
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        args = run_args(hidden, depth, out / "run", [*layout.overrides(), *extra])
        return launch(root, layout, args, out)


def row(layout: Layout, hidden: int, ranks: list[dict], tiny: list[dict]) -> str:
    over = [r["peak"] - t["peak"] for r, t in zip(ranks, tiny, strict=True)]
    built = [r["built_rss"] - t["built_rss"] for r, t in zip(ranks, tiny, strict=True)]
    ratios = [o / r["share"] for o, r in zip(over, ranks, strict=True)]
    worst = max(range(len(ranks)), key=lambda i: ratios[i])
    verdict = "" if layout.executor == "local" else (" ok" if ratios[worst] <= LIMIT else " OVER")
    return (
        f"| {hidden} | {layout.label()} | {max(r['build_s'] for r in ranks):.1f} | "
        f"{built[worst] / MIB:.0f} | {ranks[worst]['params'] / MIB:.0f} | "
        f"{max(r['peak'] for r in ranks) / MIB:.0f} | {max(t['peak'] for t in tiny) / MIB:.0f} | "
        f"{ranks[worst]['share'] / MIB:.0f} | {over[worst] / MIB:.0f} | "
        f"{ratios[worst]:.2f}{verdict} |"
    )


HEADER = (
    "| hidden | layout | build s | built over tiny MiB | params MiB | peak MiB | tiny peak MiB "
    "| share MiB | over tiny MiB | ratio |\n" + "|---" * 10 + "|"
)


def table(root: Path, layouts: list[Layout], sizes: list[int], depth: int, extra: list[str]) -> str:
    """The table's rows; ``extra``: Hydra overrides for every run, the tiny ones included."""
    lines = [HEADER]
    for layout in layouts:
        print(f"{layout.label()}: tiny ...", file=sys.stderr, flush=True)
        tiny = measure(root, layout, TINY, depth, extra)
        for hidden in sizes:
            print(f"{layout.label()}: hidden {hidden} ...", file=sys.stderr, flush=True)
            ranks = measure(root, layout, hidden, depth, extra)
            lines.append(row(layout, hidden, ranks, tiny))
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def giant(root: Path, depth: int, hidden: int) -> str:
    """A model whose whole copy per rank would not fit this machine, K=4, plain SGD (no
    momentum: parameters and gradients are the state): two steps and a save, then a resume to
    step 3, every rank's figures each time, and the steps metrics.jsonl holds after each."""
    layout = Layout("distributed", 4)
    lines = [
        "| run | layout | build s | peak after the build GiB | params GiB | peak GiB, ranks 0-3 "
        "| share GiB | steps logged |\n" + "|---" * 8 + "|"
    ]
    plain_sgd = [
        "optim.momentum=0", "optim.nesterov=false", "trainer.log_every=1", *layout.overrides()
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        run_dir = Path(tmp) / "run"
        for name, steps, extra in (
            ("2 steps, saved", 2, []),
            ("resumed to step 3", 3, ["trainer.resume=true"]),
        ):
            out = Path(tmp) / f"step{steps}"
            out.mkdir()
            args = run_args(hidden, depth, run_dir, plain_sgd + extra, steps, save=True)
            ranks = launch(root, layout, args, out)
            peaks = " / ".join(f"{r['peak'] / 2**30:.2f}" for r in ranks)
            logged = [
                json.loads(line)["step"]
                for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("kind") == "train"
            ]
            lines.append(
                f"| {name} | {layout.label()} | {max(r['build_s'] for r in ranks):.1f} | "
                f"{max(r['built_rss'] for r in ranks) / 2**30:.2f} | "
                f"{max(r['params'] for r in ranks) / 2**30:.2f} | {peaks} | "
                f"{max(r['share'] for r in ranks) / 2**30:.2f} | {logged} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    model_gb = depth * (hidden**2 + hidden) * 4 / 1e9
    return f"hidden {hidden}, depth {depth}: a {model_gb:.2f} GB model\n\n" + "\n".join(lines)


GIANT_HIDDEN = 8192
"""depth 26 x Linear(8192): 1.75 B parameters, 7.0 GB in fp32 (four whole copies: 28 GB)."""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        split = sys.argv.index("--")
        worker(Path(sys.argv[2]), Path(sys.argv[4]), sys.argv[split + 1 :])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, K = 2")
    parser.add_argument(
        "--giant", type=int, metavar="DEPTH", help="hidden 8192 x DEPTH (26: 7 GB) at K = 4"
    )
    parser.add_argument(
        "--hidden", type=int, default=GIANT_HIDDEN, help="--giant's width (a smaller check)"
    )
    parser.add_argument("--sizes", help="hidden widths, e.g. '2048,4096' (the default)")
    parser.add_argument("--depth", type=int, default=16, help="layers of hidden width")
    parser.add_argument("--root", type=Path, default=HERE, help="the checkout to measure")
    parser.add_argument(
        "--mmap-threshold", type=int, default=0, metavar="BYTES", help="MALLOC_MMAP_THRESHOLD_"
    )
    parser.add_argument(
        "--layouts", help="only these, in this order, e.g. 'torchrun K=4 x R=1,local K=2'"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override for every run of the table (repeatable), e.g. optim.nesterov=false",
    )
    args = parser.parse_args()
    global MMAP_THRESHOLD
    MMAP_THRESHOLD = args.mmap_threshold
    root = args.root.resolve()
    load = os.getloadavg()[0]
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"{root} at {commit}, {os.cpu_count()} CPUs, load average at start {load:.2f}")
    print(f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD or 'glibc default'}")
    print(f"overrides: {' '.join(args.set) or 'none'}")
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    if args.layouts:  # in the order given (e.g. the torchrun rows, which the bound is about, first)
        named = {lay.label(): lay for lay in LAYOUTS}
        layouts = [named[label.strip()] for label in args.layouts.split(",")]
    if args.giant:
        report = giant(root, args.giant, args.hidden)
    elif args.quick:
        report = table(root, layouts, [256, 512], 4, args.set)
    else:
        sizes = [int(size) for size in (args.sizes or "2048,4096").split(",")]
        report = table(root, layouts, sizes, args.depth, args.set)
    print(f"\n{report}\n\nload average now {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
