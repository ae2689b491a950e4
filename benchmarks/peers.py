"""Peers on this machine's CPU, K=2: giantpipe's local and distributed executors against
torchgpipe and torch.distributed.pipelining, on three models.

    python benchmarks/peers.py            # full run: 30-60 min on 2 shared cores
    python benchmarks/peers.py --quick    # tiny sizes, one pass timed and sampled; the tests

Hardware: any CPU; two stages, one core each (the whole benchmark runs with OMP_NUM_THREADS=1:
on a shared 2-core VM OpenMP with 2 threads per process is 30-60x slower under load, and every
method then gets the same: one core per stage).
Reproduces: no paper number; the method of benchmarks/engine_cpu.py (whose functions this
imports: ``mlp``, ``plain_step``, ``timed``) on more models. Expect giantpipe's local executor at
or above torchgpipe, and both executors close to torch.distributed.pipelining.

Models (loss: MSE against a fixed random target of the output's shape, for every method; this
measures throughput, not learning), cut into 2 stages by measured time (one cut for all):

    mlp          engine_cpu.mlp: 8 x (Linear 1024 + ReLU), batch 512
    amoebanet    AmoebaNet-D (6, 32) (models/amoebanet.py), 64 px, 10 classes, batch 32
    transformer  Transformer-L (models/transformer_lm.py), 12 layers, d 128, FFN 512, 4 heads,
                 1000-token vocabulary, 32 tokens, batch 16

Methods, checkpoint 'never' everywhere, in interleaved rounds (medians reported):

    plain         the un-pipelined model, whole batch, one core
    plain-mb      the same, micro-batch by micro-batch (gradient accumulation), one core
    gp-local-*    giantpipe GPipe.train_step, 2 CPU stand-in workers (threads), gpipe / 1f1b
    gp-dist-*     giantpipe DistributedPipe, 2 gloo processes, gpipe / 1f1b
    torchgpipe    torchgpipe 0.0.7 GPipe, devices ['cpu', 'cpu'] (threads)
    pippy-*       torch.distributed.pipelining ScheduleGPipe / Schedule1F1B, 2 gloo processes

The bound for K=2 is engine_cpu.py's: 2 x (plain-mb throughput on one core) x M / (M + 1).
Peak memory: the largest growth of resident memory (RSS, sampled every millisecond) over one
training step (after a first one), above the level just before it; for 2-process methods the
sum of both processes. It is measured in a separate pass, a child process in which glibc returns
every allocation of 4 KiB or more to the OS on free (MALLOC_MMAP_THRESHOLD_=4096), so that RSS
follows live tensors; the timed rounds run with the default allocator settings.
Writes results/peers/peers.md and results/peers/peers.png.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT), str(ROOT / "src")]

from giantpipe.testing.outputs import add_output_options, output_path  # noqa: E402


@dataclass(frozen=True)
class Setup:
    """Sizes of one run of the benchmark."""

    models: tuple[str, ...]
    chunks: tuple[int, ...]
    rounds: int
    steps: int
    quick: bool
    one_pass: bool = False
    """The timed steps run in the memory pass's processes, after its sampled step (no timed
    round of their own: two processes fewer, the times under its allocator setting)."""


FULL = Setup(("mlp", "amoebanet", "transformer"), chunks=(1, 4, 8), rounds=3, steps=2, quick=False)
QUICK = Setup(("mlp", "amoebanet", "transformer"), chunks=(1, 2), rounds=1, steps=1, quick=True,
              one_pass=True)  # fmt: skip


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one pass (for tests)")
    add_output_options(p, "peers")
    p.add_argument("--models", nargs="+", choices=FULL.models)
    p.add_argument("--memory-pass", type=Path, help=argparse.SUPPRESS)  # the child process
    return p.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.multiprocessing as mp
from engine_cpu import mlp, plain_step, timed  # noqa: E402
from torch import nn

from giantpipe import GPipe  # noqa: E402
from giantpipe.perf.balance import balance_by_time  # noqa: E402
from giantpipe.testing import free_port, rank_env  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1"}
MEMORY_ENV = {**ENV, "MALLOC_MMAP_THRESHOLD_": "4096"}  # the memory pass: RSS = live memory
MIB = 2**20
Key = tuple[str, int]  # (method, M)
LOCAL = ("gp-local-gpipe", "gp-local-1f1b", "torchgpipe")
REMOTE = ("gp-dist-gpipe", "gp-dist-1f1b", "pippy-gpipe", "pippy-1f1b")
METHODS = (*LOCAL, *REMOTE)


# ---- models ---------------------------------------------------------------------------------


SIZES = {  # name -> (full sizes, quick sizes): SIZES[name][quick]
    "mlp": (
        {"width": 1024, "blocks": 8, "batch": 512},
        {"width": 64, "blocks": 4, "batch": 32},
    ),
    "amoebanet": (
        {"layers": 6, "filters": 32, "batch": 32, "image": 64},
        {"layers": 3, "filters": 8, "batch": 8, "image": 32},
    ),
    "transformer": (
        {"layers": 12, "d": 128, "batch": 16, "seq": 32},
        {"layers": 2, "d": 32, "batch": 8, "seq": 8},
    ),
}


def model_of(name: str, quick: bool) -> nn.Sequential:
    """The model, seeded (every process builds the same one; also on the meta device)."""
    from models.amoebanet import amoebanetd
    from models.transformer_lm import transformer_lm

    size = SIZES[name][quick]
    torch.manual_seed(0)
    if name == "mlp":
        return mlp(size["width"], size["blocks"])
    if name == "amoebanet":
        return amoebanetd(size["layers"], size["filters"], 10, size["image"])
    d = size["d"]
    return transformer_lm(size["layers"], d_model=d, ffn_dim=4 * d, num_heads=4, vocab_size=1000,
                          max_len=size["seq"])  # fmt: skip


def build(name: str, quick: bool) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """(model, inputs, target), all seeded."""
    model, size = model_of(name, quick), SIZES[name][quick]
    if name == "mlp":
        x = torch.randn(size["batch"], size["width"])
    elif name == "amoebanet":
        x = torch.randn(size["batch"], 3, size["image"], size["image"])
    else:
        x = torch.randint(0, 1000, (size["batch"], size["seq"]))
    with torch.no_grad():
        target = torch.randn_like(model.eval()(x))
    return model.train(), x, target


def balance_of(name: str, quick: bool, chunks: int) -> list[int]:
    """Two stages by measured time on one micro-batch (the same cut for every method)."""
    model, x, _ = build(name, quick)
    return balance_by_time(2, model, x[: max(1, len(x) // chunks)])


# ---- memory ---------------------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss_growth(into: list[int]) -> Iterator[None]:
    """Appends to ``into`` the largest RSS growth over the body (sampled every millisecond)."""
    gc.collect()  # garbage of earlier steps is not this step's memory
    base, peak, stop = rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
        into.append(max(0, peak[0] - base))


def measure(step: Callable[[], None], steps: int, memory: bool) -> tuple[float, int | None]:
    """Seconds per step (engine_cpu.timed) and, if asked, the peak RSS growth of one step
    after a first one (which also allocates what lives on: buffers, communicators)."""
    peaks: list[int] = []
    if memory:
        step()
        with peak_rss_growth(peaks):
            step()
    return (timed(step, steps) if steps else math.nan), peaks[0] if peaks else None


# ---- in one process: plain, giantpipe local, torchgpipe ------------------------------------


def local_steps(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, balance: list[int]
                ) -> dict[str, Callable[[], None]]:  # fmt: skip
    """One step function per local pipeline method, each on its own copy of the model."""
    loss = nn.functional.mse_loss
    steps: dict[str, Callable[[], None]] = {}
    for schedule in ("gpipe", "1f1b"):
        try:
            pipe = GPipe(copy.deepcopy(model), balance, devices=["cpu", "cpu"], chunks=m,
                         checkpoint="never", schedule=schedule)  # fmt: skip
        except ValueError:
            continue  # a schedule that cannot run this M

        def step(pipe: GPipe = pipe) -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(x, y, loss)

        steps[f"gp-local-{schedule}"] = step
    try:
        import torchgpipe

        tg = torchgpipe.GPipe(copy.deepcopy(model), balance, devices=["cpu", "cpu"], chunks=m,
                              checkpoint="never")  # fmt: skip

        def tg_step() -> None:
            tg.zero_grad(set_to_none=True)
            loss(tg(x), y).backward()

        steps["torchgpipe"] = tg_step
    except ImportError:
        pass
    return steps


def local_round(name: str, setup: Setup, balances: dict[int, list[int]], memory: bool
                ) -> tuple[dict[Key, float], dict[Key, int]]:  # fmt: skip
    model, x, y = build(name, setup.quick)
    seconds: dict[Key, float] = {}
    peaks: dict[Key, int] = {}

    def record(key: Key, step: Callable[[], None]) -> None:
        seconds[key], peak = measure(step, setup.steps, memory)
        if peak is not None:
            peaks[key] = peak

    record(("plain", 0), plain_step(copy.deepcopy(model), x, y, 1))
    for m in setup.chunks:
        record(("plain-mb", m), plain_step(copy.deepcopy(model), x, y, m))
        for method, step in local_steps(model, x, y, m, balances[m]).items():
            record((method, m), step)
    return seconds, peaks


# ---- two gloo processes: giantpipe distributed and torch.distributed.pipelining -------------


class Unpack(nn.Module):
    """pippy hands a tuple output to the next stage as several arguments: pack them again."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *xs: torch.Tensor) -> object:
        return self.inner(xs[0] if len(xs) == 1 else xs)


def _dist_steps(name: str, setup: Setup, rank: int, m: int, balance: list[int]
                ) -> dict[str, Callable[[], None]]:  # fmt: skip
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from giantpipe.engine.distributed.pipe import DistributedPipe

    model, x, y = build(name, setup.quick)
    loss = nn.functional.mse_loss
    steps: dict[str, Callable[[], None]] = {}
    for schedule in ("gpipe", "1f1b"):
        try:
            pipe = DistributedPipe(lambda: model_of(name, setup.quick), balance, chunks=m,
                                   recompute="never", schedule=schedule, timeout=300)  # fmt: skip
        except ValueError:
            continue

        def gp(pipe: DistributedPipe = pipe) -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(x if pipe.needs_inputs else None,
                            y if pipe.needs_targets else None, loss)  # fmt: skip

        steps[f"gp-dist-{schedule}"] = gp
    part = model[: balance[0]] if rank == 0 else Unpack(model[balance[0] :])
    for label, cls in (("pippy-gpipe", ScheduleGPipe), ("pippy-1f1b", Schedule1F1B)):
        if cls is Schedule1F1B and m < 2:
            continue  # 1F1B needs at least as many micro-batches as stages
        stage = PipelineStage(part, rank, 2, torch.device("cpu"))
        schedule_ = cls(stage, n_microbatches=m, loss_fn=loss)

        def pp(schedule_: object = schedule_) -> None:
            part.zero_grad(set_to_none=True)
            if rank == 0:
                schedule_.step(x)  # type: ignore[attr-defined]
            else:
                schedule_.step(target=y, losses=[])  # type: ignore[attr-defined]

        steps[label] = pp
    return steps


def _dist_worker(rank: int, port: int, names: tuple[str, ...], setup: Setup,
                 balances: dict[str, dict[int, list[int]]], memory: bool, out: str
                 ) -> None:  # fmt: skip
    import torch.distributed as dist

    from giantpipe.engine.distributed.pipe import end_distributed

    torch.set_num_threads(1)
    os.environ.update(rank_env(rank, 2, port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    rows = []
    for name in names:
        for m in setup.chunks:
            for method, step in _dist_steps(name, setup, rank, m, balances[name][m]).items():
                dist.barrier()
                seconds, peak = measure(step, setup.steps, memory)
                rows.append((name, method, m, seconds, peak))
    torch.save(rows, f"{out}.{rank}")
    end_distributed()  # every group freed now, not during the shutdown


def dist_round(names: tuple[str, ...], setup: Setup, balances: dict[str, dict[int, list[int]]],
               memory: bool) -> dict[str, tuple[dict[Key, float], dict[Key, int]]]:  # fmt: skip
    """Every model's distributed methods, in one pair of gloo processes (one start-up of two
    processes per round, not per model); per model: (seconds, peaks)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        args = (free_port(), names, setup, balances, memory, out)
        mp.start_processes(_dist_worker, args=args, nprocs=2, start_method="spawn")
        ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    found: dict[str, tuple[dict[Key, float], dict[Key, int]]] = {n: ({}, {}) for n in names}
    # the step ends on the last rank (it computes the loss); memory: both processes together
    for name, method, m, sec, _ in ranks[1]:
        found[name][0][(method, m)] = sec
    for rows in ranks:
        for name, method, m, _, peak in rows:
            if peak is not None:
                peaks = found[name][1]
                peaks[(method, m)] = peaks.get((method, m), 0) + peak
    return found


# ---- the rounds, the tables, the plot --------------------------------------------------------


@dataclass
class Result:
    rate: dict[Key, float]  # samples/s, median over rounds
    peak: dict[Key, int]  # bytes, from the first round
    balances: dict[int, list[int]]
    batch: int


def benchmark(setup: Setup, balances: dict[str, dict[int, list[int]]]) -> dict[str, Result]:
    """Interleaved timed rounds (no memory sampling), medians of samples/s; in each round every
    model's local methods, then every model's distributed ones."""
    rounds: dict[str, list[dict[Key, float]]] = {name: [] for name in setup.models}
    for r in range(setup.rounds):
        print(f"round {r + 1}/{setup.rounds}", file=sys.stderr, flush=True)
        local = {name: local_round(name, setup, balances[name], False)[0] for name in setup.models}
        for name, (seconds, _) in dist_round(setup.models, setup, balances, False).items():
            rounds[name].append({**local[name], **seconds})
    results = {}
    for name, per_round in rounds.items():
        batch = SIZES[name][setup.quick]["batch"]
        keys = {k for rd in per_round for k in rd}
        rate = {k: batch / statistics.median(rd[k] for rd in per_round if k in rd) for k in keys}
        results[name] = Result(rate, {}, balances[name], batch)
    return results


def memory_pass(setup: Setup, path: Path) -> None:
    """In the child process: one memory-sampled step per method (then, with
    ``setup.one_pass``, its timed steps); reads the balances from ``path`` and writes the peaks
    (and the seconds) back into it."""
    balances = {
        n: {int(m): b for m, b in per.items()} for n, per in json.loads(path.read_text()).items()
    }
    once = setup if setup.one_pass else replace(setup, steps=0)
    print("memory pass", file=sys.stderr, flush=True)
    found = {name: local_round(name, once, balances[name], True) for name in setup.models}
    for name, (seconds, peaks) in dist_round(setup.models, once, balances, True).items():
        found[name][0].update(seconds)
        found[name][1].update(peaks)
    path.write_text(json.dumps({
        name: {
            "peak": [[method, m, peak] for (method, m), peak in peaks.items()],
            "seconds": [[method, m, sec] for (method, m), sec in seconds.items()]
            if setup.one_pass else [],
        }
        for name, (seconds, peaks) in found.items()
    }))  # fmt: skip


def run_memory_pass(setup: Setup, results: dict[str, Result], argv: Sequence[str]) -> None:
    """Runs :func:`memory_pass` in a child process with MEMORY_ENV; fills ``Result.peak``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.json"
        path.write_text(json.dumps({n: r.balances for n, r in results.items()}))
        command = [sys.executable, __file__, *argv, "--memory-pass", str(path)]
        subprocess.run(command, env={**os.environ, **MEMORY_ENV}, check=True)
        for name, rows in json.loads(path.read_text()).items():
            r = results[name]
            r.peak = {(method, m): peak for method, m, peak in rows["peak"]}
            r.rate.update({(method, m): r.batch / sec for method, m, sec in rows["seconds"]})


def bound(result: Result, m: int) -> float:
    """engine_cpu.py's bound: two cores at plain-mb's speed, minus the fill-drain bubble."""
    return 2 * result.rate[("plain-mb", m)] * m / (m + 1)


def throughput_table(name: str, setup: Setup, r: Result) -> str:
    plain = r.rate[("plain", 0)]
    lines = [
        f"### {name}: batch {r.batch}, balance {r.balances[setup.chunks[-1]]} (by time); "
        "samples/s (x bound, x plain)",
        "",
        "| M | plain | plain-mb | bound | " + " | ".join(METHODS) + " |",
        "|---" * (len(METHODS) + 4) + "|",
    ]
    for m in setup.chunks:
        b, cells = bound(r, m), []
        for method in METHODS:
            v = r.rate.get((method, m))
            cells.append("-" if v is None else f"{v:.1f} ({v / b:.2f}, {v / plain:.2f})")
        lines.append(f"| {m} | {plain:.1f} | {r.rate[('plain-mb', m)]:.1f} | {b:.1f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def memory_table(name: str, setup: Setup, r: Result) -> str:
    methods = ["plain-mb", *METHODS]
    lines = [
        f"### {name}: peak RSS growth over one step, MiB (2-process methods: both processes)",
        "",
        "| M | plain | " + " | ".join(methods) + " |",
        "|---" * (len(methods) + 2) + "|",
    ]
    for m in setup.chunks:
        cells = [f"{r.peak[(k, m)] / MIB:.1f}" if (k, m) in r.peak else "-" for k in methods]
        lines.append(
            f"| {m} | {r.peak.get(('plain', 0), 0) / MIB:.1f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def plot(setup: Setup, results: dict[str, Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    width = 0.8 / len(METHODS)
    for ax, (name, r) in zip(axes[0], results.items()):
        for i, method in enumerate(METHODS):
            xs = [j + i * width for j, m in enumerate(setup.chunks) if (method, m) in r.rate]
            ys = [r.rate[(method, m)] / bound(r, m) for m in setup.chunks if (method, m) in r.rate]
            ax.bar(xs, ys, width, label=method, color=f"C{i}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(setup.chunks))])
        ax.set_xticklabels([f"M={m}" for m in setup.chunks])
        ax.set(title=f"{name}, K=2 on CPU", ylabel="fraction of the bound")
        ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reexec_with_env() -> None:
    """Restart once with ENV set: OpenMP reads the thread count at start-up."""
    if any(os.environ.get(k) != v for k, v in ENV.items()):
        os.environ.update(ENV)
        os.execv(sys.executable, [sys.executable, *sys.argv])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    args.out = output_path(args, ROOT, "peers")
    setup = QUICK if args.quick else FULL
    if args.models:
        setup = replace(setup, models=tuple(args.models))
    if args.memory_pass:
        memory_pass(setup, args.memory_pass)
        return 0
    started, load = datetime.datetime.now(), os.getloadavg()[0]
    balances = {n: {m: balance_of(n, setup.quick, m) for m in setup.chunks} for n in setup.models}
    if setup.one_pass:
        batches = {n: SIZES[n][setup.quick]["batch"] for n in setup.models}
        results = {n: Result({}, {}, balances[n], batches[n]) for n in setup.models}
    else:
        results = benchmark(setup, balances)
    run_memory_pass(setup, results, sys.argv[1:] if argv is None else argv)
    parts = [
        f"# Peers on CPU, K=2{' (--quick)' if setup.quick else ''}\n\n"
        f"`python benchmarks/peers.py{' --quick' if setup.quick else ''}`, "
        f"{started:%Y-%m-%d %H:%M}, torch {torch.__version__}, {os.cpu_count()} CPUs (shared), no "
        f"GPU, OMP_NUM_THREADS=1; load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at "
        f"end; median of {setup.rounds} rounds x {setup.steps} steps, checkpoint never"
        + (", timed in the memory pass (its allocator setting)" if setup.one_pass else "")
        + ".\n"
    ]
    for name, r in results.items():
        parts += [throughput_table(name, setup, r), memory_table(name, setup, r)]
    text = "\n\n".join(parts)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.md").write_text(text + "\n")
    plot(setup, results, args.out / "peers.png")
    print(text)
    return 0


if __name__ == "__main__":
    reexec_with_env()
    raise SystemExit(main())
