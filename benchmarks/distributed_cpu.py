"""Distributed executor benchmark: 2 gloo processes x 1 core, against torch.distributed.pipelining.

    python benchmarks/distributed_cpu.py                # both models: ~40 min on 2 shared cores
    python benchmarks/distributed_cpu.py --models mlp   # one model
    python benchmarks/distributed_cpu.py --models ffn --chunks 4 8   # some Ms
    python benchmarks/distributed_cpu.py --quick        # tiny sizes, one round: seconds
    python benchmarks/distributed_cpu.py --plot results/distributed/run.png   # a figure too
    python benchmarks/distributed_cpu.py --replot OUT.txt [OUT.txt ...] --plot FIG.png
                                                        # the figure of runs printed before

Models, K=2 stages of equal halves, checkpoint 'never', MSE against a fixed random target:

    mlp   engine_cpu.py's: 8 x (Linear 1024 + ReLU), batch 512
    ffn   Transformer FFN blocks: 8 x (x + Linear(4d, d)(GELU(Linear(d, 4d)(LayerNorm(x))))),
          d 256, batch 16 x 64 tokens (as many FLOPs per step as the MLP)

M in {1, 2, 4, 8, 16}; one process per stage with ``torch.set_num_threads(1)``. Every round
starts a fresh pair of processes which, for each model and M, builds every method and times
them one step at a time in turn, giantpipe's and pippy's alternating (the order reversed every
other turn and every other round), so that the load of this shared machine hits both alike; a
round's figure is the median of its steps (the slower rank's), and the tables give medians over
rounds:

    plain-mb           the un-pipelined model micro-batch by micro-batch on one core (the base)
    gp-dist-<name>     giantpipe's DistributedPipe under every registered schedule that runs on
                       2 workers (interleaved: V=2, 4 stages; only where M is a multiple of 2)
    pippy-gpipe        torch.distributed.pipelining ScheduleGPipe
    pippy-1f1b         Schedule1F1B (M >= 2)
    pippy-interleaved  ScheduleInterleaved1F1B, 4 stages, V=2 (M >= 2)
    pippy-zbv          ScheduleZBVZeroBubble, 4 stages in a V (M >= 4)

The bound for K=2 is 2 x (plain-mb throughput on one core) x M / (M + 1), as in engine_cpu.py;
a second table divides by an in-run bound instead (plain-mb timed on one core inside rank 0's
process right before each M), which moves with the machine's load. The last table puts the
best schedule of each side against the other's, per M. ``--plot`` draws the first table (every
method's fraction of the bound, per M and model) from the printed text, so ``--replot`` can
draw a run saved earlier.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT), str(ROOT / "src")]  # run from a checkout


@dataclass(frozen=True)
class Setup:
    model: str  # "mlp" or "ffn"
    width: int  # MLP width, or FFN d
    blocks: int
    batch: int
    tokens: int  # FFN sequence length (0 for the MLP)
    chunks: tuple[int, ...]
    rounds: int
    steps: int

    def build(self) -> nn.Sequential:
        if self.model == "mlp":
            return mlp(self.width, self.blocks)
        torch.manual_seed(0)
        return nn.Sequential(*[FFNBlock(self.width) for _ in range(self.blocks)])

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        shape = (self.batch, self.width) if self.model == "mlp" else (
            self.batch, self.tokens, self.width
        )  # fmt: skip
        return torch.randn(shape), torch.randn(shape)

    def label(self) -> str:
        if self.model == "mlp":
            return f"MLP {self.blocks} x Linear({self.width}) + ReLU, batch {self.batch}"
        return (
            f"FFN {self.blocks} x (LayerNorm, Linear({self.width}, {4 * self.width}), GELU, "
            f"Linear({4 * self.width}, {self.width}), residual), batch {self.batch} x "
            f"{self.tokens} tokens"
        )


FULL = {
    "mlp": Setup("mlp", 1024, 8, 512, 0, (1, 2, 4, 8, 16), rounds=5, steps=3),
    "ffn": Setup("ffn", 256, 8, 16, 64, (1, 2, 4, 8, 16), rounds=5, steps=3),
}
QUICK = {
    "mlp": Setup("mlp", 64, 4, 32, 0, (1, 4), rounds=1, steps=1),
    "ffn": Setup("ffn", 16, 4, 8, 4, (1, 4), rounds=1, steps=1),
}


Fractions = dict[str, dict[int, float]]  # method -> M -> fraction of the bound


def parse_fractions(text: str) -> list[tuple[str, Fractions]]:
    """Each model's first table of a printed run: ``(model label, method -> M -> fraction)``.

    Example::

        >>> text = "\\n".join([
        ...     "MLP 8 x Linear(1024) + ReLU, batch 512, K=2 gloo processes",
        ...     "",
        ...     "| M | plain-mb 1 core | bound | gp-dist-1f1b | pippy-1f1b |",
        ...     "|---|---|---|---|---|",
        ...     "| 1 | 670 | 670 | 670 (1.00) | - |",
        ...     "| 4 | 620 | 992 | 933 (0.94) | 931 (0.94) |",
        ... ])
        >>> label, fractions = parse_fractions(text)[0]
        >>> label
        'MLP 8 x Linear(1024) + ReLU'
        >>> fractions
        {'gp-dist-1f1b': {1: 1.0, 4: 0.94}, 'pippy-1f1b': {4: 0.94}}
    """
    panels: list[tuple[str, Fractions]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("| M | plain-mb 1 core | bound |"):
            continue
        label = next(lines[j] for j in range(i - 1, -1, -1) if lines[j].strip())
        methods = [c.strip() for c in line.strip("|").split("|")[3:]]
        fractions: Fractions = {name: {} for name in methods}
        for row in lines[i + 2 :]:
            if not row.startswith("| "):
                break
            cells = [c.strip() for c in row.strip("|").split("|")]
            for name, cell in zip(methods, cells[3:]):
                found = re.search(r"\(([\d.]+)\)", cell)
                if found:
                    fractions[name][int(cells[0])] = float(found.group(1))
        rounds = re.search(r"median of (\d+) rounds", label)
        name = label.split(", batch")[0] + (f", {rounds.group(1)} rounds" if rounds else "")
        panels.append((name, fractions))
    return panels


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--models", nargs="+", choices=sorted(FULL), default=sorted(FULL))
    parser.add_argument("--rounds", type=int, help="rounds per model (default 5; --quick 1)")
    parser.add_argument("--chunks", type=int, nargs="+", help="the Ms to run (default 1-16)")
    parser.add_argument("--plot", type=Path, help="also draw the run as a figure (PNG) here")
    parser.add_argument("--replot", type=Path, nargs="+", help="draw runs printed before (no run)")
    args = parser.parse_args(argv)
    if args.replot:
        if args.plot is None:
            parser.error("--replot needs --plot PATH")
        for path in args.replot:
            if not path.is_file():
                parser.error(f"--replot: no such file: {path}")
        args.panels = [panel for path in args.replot for panel in parse_fractions(path.read_text())]
        if not args.panels:
            parser.error(f"--replot: no table of a run in {', '.join(map(str, args.replot))}")
    return args


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.multiprocessing as mp
from engine_cpu import mlp, plain_step, timed  # noqa: E402
from torch import nn

from giantpipe.engine.distributed.pipe import DistributedPipe, end_distributed  # noqa: E402
from giantpipe.engine.schedules import build_schedule, schedule_builders  # noqa: E402
from giantpipe.testing import free_port, rank_env  # noqa: E402

Key = tuple[str, int]  # (method, M)
Step = Callable[[], None]


class FFNBlock(nn.Module):
    """A Transformer's feed-forward sublayer, pre-norm with its residual: one partition unit."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def schedules_for_two_workers(chunks: int) -> list[tuple[str, int]]:
    """Every registered schedule that runs on K=2 workers at this M, with the smallest V."""
    found = []
    for name in sorted(schedule_builders()):
        for v in (1, 2):
            try:
                build_schedule(name, 2, chunks, v)
            except ValueError:
                continue
            found.append((name, v))
            break
    return found


# ---- the methods, inside one of the two processes ---------------------------------------------


def giantpipe_steps(
    setup: Setup,
    chunks: int,
    x: torch.Tensor,
    y: torch.Tensor,
    pipe_class: type[DistributedPipe] = DistributedPipe,
    prefix: str = "gp-dist-",
) -> dict[str, Step]:
    """A step of ``pipe_class`` (another revision's DistributedPipe: distributed_commits.py)
    under every schedule that runs on two workers, named ``<prefix><schedule>``."""
    steps: dict[str, Step] = {}
    for name, v in schedules_for_two_workers(chunks):
        stages = 2 * v
        pipe = pipe_class(
            setup.build,
            [setup.blocks // stages] * stages,
            chunks=chunks,
            recompute="never",
            schedule=name,
            virtual_stages=v,
            timeout=300,
        )

        def step(pipe: DistributedPipe = pipe) -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(
                x if pipe.needs_inputs else None,
                y if pipe.needs_targets else None,
                nn.functional.mse_loss,
            )

        steps[f"{prefix}{name}"] = step
    return steps


def pippy_steps(
    setup: Setup, chunks: int, rank: int, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Step]:
    from torch.distributed import pipelining as pp

    model = setup.build()
    # (label, schedule class, the stages this rank holds out of how many, least M)
    plans = [
        ("pippy-gpipe", pp.ScheduleGPipe, [rank], 2, 1),
        ("pippy-1f1b", pp.Schedule1F1B, [rank], 2, 2),
        ("pippy-interleaved", pp.ScheduleInterleaved1F1B, [rank, rank + 2], 4, 2),
        ("pippy-zbv", pp.ScheduleZBVZeroBubble, [rank, 3 - rank], 4, 4),
    ]
    steps: dict[str, Step] = {}
    for label, cls, held, num, least in plans:
        if chunks < least:
            continue
        size = setup.blocks // num
        stages = [
            pp.PipelineStage(model[i * size : (i + 1) * size], i, num, torch.device("cpu"))
            for i in held
        ]
        schedule = cls(
            stages[0] if num == 2 else stages, n_microbatches=chunks, loss_fn=nn.functional.mse_loss
        )
        steps[label] = _pippy_step(model, schedule, 0 in held, num - 1 in held, x, y)
    return steps


def _pippy_step(
    model: nn.Module, schedule: object, first: bool, last: bool, x: torch.Tensor, y: torch.Tensor
) -> Step:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        kwargs = {"target": y, "losses": []} if last else {}
        schedule.step(*((x,) if first else ()), **kwargs)  # type: ignore[attr-defined]

    return step


def alternate(ours: dict[str, Step], theirs: dict[str, Step], flip: bool) -> list[tuple[str, Step]]:
    """giantpipe's and pippy's methods one after the other; the whole order reversed if flip."""
    a, b = list(ours.items()), list(theirs.items())
    order = [m for pair in zip(a, b) for m in pair] + a[len(b) :] + b[len(a) :]
    return order[::-1] if flip else order


def round_robin(methods: list[tuple[str, Step]], steps: int) -> dict[str, float]:
    """Median seconds per step of each method, timed one step at a time in turn (the order
    reversed every other turn) after a warm-up step each: a load drift of the machine lands on
    every method alike. Each step starts at a barrier, after a full garbage collection (a
    generation-2 collection inside a step stalls every rank, see engine_cpu.timed)."""
    import torch.distributed as dist

    def one(step: Step) -> float:
        gc.collect()
        dist.barrier()
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    for _, step in methods:
        one(step)
    times: dict[str, list[float]] = {name: [] for name, _ in methods}
    for turn in range(steps):
        for name, step in methods if turn % 2 == 0 else methods[::-1]:
            times[name].append(one(step))
    return {name: statistics.median(t) for name, t in times.items()}


def _worker(rank: int, port: int, setups: list[Setup], flip: bool, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(rank_env(rank, 2, port))
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    results = []
    for i, setup in enumerate(setups):
        x, y = setup.data()
        for chunks in setup.chunks:
            # The in-run bound: plain-mb on one core of this very process, right before the
            # pipelines (rank 1 idles at the barrier), so that load drifts hit both alike.
            if rank == 0:
                plain = timed(plain_step(setup.build(), x, y, chunks), setup.steps)
                results.append((i, "plain-mb-inrun", chunks, plain))
            dist.barrier()
            ours = giantpipe_steps(setup, chunks, x, y)
            theirs = pippy_steps(setup, chunks, rank, x, y)
            medians = round_robin(alternate(ours, theirs, flip), setup.steps)
            results += [(i, name, chunks, seconds) for name, seconds in medians.items()]
            del ours, theirs
    torch.save(results, f"{out_path}.{rank}")
    dist.barrier()
    end_distributed()  # every group freed now, not during the shutdown


def one_round(setups: list[Setup], flip: bool) -> list[dict[Key, float]]:
    """Per model, seconds per step of every method at every M (the slower rank's), and
    plain-mb; every model's pipelines in one pair of gloo processes (one start-up a round)."""
    torch.set_num_threads(1)
    seconds: list[dict[Key, float]] = [{} for _ in setups]
    for setup, found in zip(setups, seconds):
        x, y = setup.data()
        for m in setup.chunks:
            found[("plain-mb", m)] = timed(plain_step(setup.build(), x, y, m), setup.steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        args = (free_port(), setups, flip, out)
        mp.start_processes(_worker, args=args, nprocs=2, start_method="spawn")
        for rank in (0, 1):
            for i, name, m, sec in torch.load(f"{out}.{rank}"):
                seconds[i][(name, m)] = max(sec, seconds[i].get((name, m), 0.0))
    return seconds


# ---- tables -----------------------------------------------------------------------------------


def bound(setup: Setup, plain_seconds: float, m: int) -> float:
    return 2 * setup.batch / plain_seconds * m / (m + 1)


def tables(setup: Setup, rounds: list[dict[Key, float]]) -> str:
    keys = {k for rd in rounds for k in rd}
    median = {k: statistics.median(rd[k] for rd in rounds if k in rd) for k in keys}
    rate = {k: setup.batch / v for k, v in median.items()}
    ours = sorted({n for n, _ in keys if n.startswith("gp-dist")})
    theirs = [n for n in ("pippy-gpipe", "pippy-1f1b", "pippy-interleaved", "pippy-zbv")]
    methods = ours + [n for n in theirs if any(k[0] == n for k in keys)]
    lines = [
        f"{setup.label()}, K=2 gloo processes x 1 thread, checkpoint never; median of "
        f"{len(rounds)} rounds; samples/s (fraction of bound)",
        "",
        "| M | plain-mb 1 core | bound | " + " | ".join(methods) + " |",
        "|---" * (len(methods) + 3) + "|",
    ]
    for m in setup.chunks:
        b = bound(setup, median[("plain-mb", m)], m)
        cells = [
            "-" if (n, m) not in rate else f"{rate[(n, m)]:.0f} ({rate[(n, m)] / b:.2f})"
            for n in methods
        ]
        lines.append(f"| {m} | {rate[('plain-mb', m)]:.0f} | {b:.0f} | " + " | ".join(cells) + " |")
    lines += ["", *inrun_table(setup, rounds, methods), "", *best_table(setup, rounds, rate)]
    return "\n".join(lines)


def inrun_table(setup: Setup, rounds: list[dict[Key, float]], methods: list[str]) -> list[str]:
    """Fractions of the in-run bound (plain-mb timed inside rank 0's process just before),
    median over rounds of each round's fraction: steadier on a loaded machine."""
    lines = [
        "Same runs, fraction of the in-run bound (plain-mb on one core of rank 0's process, timed "
        "right before; median of per-round fractions):",
        "",
        "| M | in-run bound | " + " | ".join(methods) + " |",
        "|---" * (len(methods) + 2) + "|",
    ]
    for m in setup.chunks:
        inrun = [bound(setup, rd[("plain-mb-inrun", m)], m) for rd in rounds]
        cells = []
        for n in methods:
            fractions = [
                setup.batch / rd[(n, m)] / bound(setup, rd[("plain-mb-inrun", m)], m)
                for rd in rounds
                if (n, m) in rd
            ]
            cells.append(f"{statistics.median(fractions):.2f}" if fractions else "-")
        lines.append(f"| {m} | {statistics.median(inrun):.0f} | " + " | ".join(cells) + " |")
    return lines


def _best(rates: dict[str, float], prefix: str) -> tuple[str, float]:
    side = {n: r for n, r in rates.items() if n.startswith(prefix)}
    name = max(side, key=lambda n: side[n])
    return name, side[name]


def best_table(setup: Setup, rounds: list[dict[Key, float]], rate: dict[Key, float]) -> list[str]:
    """Best schedule against best schedule, per M: by medians, and paired within each round."""
    lines = [
        "Best schedule against best schedule (medians; 'paired': median over rounds of each "
        "round's best-to-best ratio):",
        "",
        "| M | bound | best giantpipe | best pippy | giantpipe / pippy | paired | giantpipe "
        "fraction of bound | pippy fraction of bound |",
        "|---" * 8 + "|",
    ]
    for m in setup.chunks:
        at_m = {n: r for (n, mm), r in rate.items() if mm == m}
        b = bound(setup, setup.batch / rate[("plain-mb", m)], m)
        gp, gp_rate = _best(at_m, "gp-dist-")
        pp, pp_rate = _best(at_m, "pippy-")
        paired = []
        for rd in rounds:
            per = {n: setup.batch / s for (n, mm), s in rd.items() if mm == m}
            paired.append(_best(per, "gp-dist-")[1] / _best(per, "pippy-")[1])
        lines.append(
            f"| {m} | {b:.0f} | {gp[8:]} {gp_rate:.0f} | {pp[6:]} {pp_rate:.0f} | "
            f"{gp_rate / pp_rate:.2f}x | {statistics.median(paired):.2f}x | {gp_rate / b:.2f} | "
            f"{pp_rate / b:.2f} |"
        )
    return lines


# ---- the figure ----------------------------------------------------------------------------


def plot(panels: list[tuple[str, Fractions]], path: Path) -> None:
    """One panel per model: every method's fraction of the bound at each M (giantpipe's
    schedules in blues, pippy's in oranges), the bound as a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
    for ax, (label, fractions) in zip(axes[0], panels):
        ms = sorted({m for per in fractions.values() for m in per})
        ours = [n for n in fractions if n.startswith("gp-dist-")]
        theirs = [n for n in fractions if not n.startswith("gp-dist-")]
        width = 0.8 / max(1, len(fractions))
        colours = {n: plt.cm.Blues(0.45 + 0.5 * i / max(1, len(ours))) for i, n in enumerate(ours)}
        colours |= {n: plt.cm.Oranges(0.4 + 0.5 * i / max(1, len(theirs)))
                    for i, n in enumerate(theirs)}  # fmt: skip
        for i, name in enumerate([*ours, *theirs]):
            xs = [j + i * width for j, m in enumerate(ms) if m in fractions[name]]
            ys = [fractions[name][m] for m in ms if m in fractions[name]]
            ax.bar(xs, ys, width, label=name, color=colours[name])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ms))])
        ax.set_xticklabels([f"M={m}" for m in ms])
        ax.set_ylim(0.0, max(1.3, *(v for per in fractions.values() for v in per.values())))
        ax.set_title(f"{label}, K=2 gloo processes", fontsize=8)
        ax.set_ylabel("fraction of the bound")
        ax.legend(fontsize=6, ncol=2, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse()
    if args.replot:
        plot(args.panels, args.plot)
        print(f"wrote {args.plot}")
        return
    setups = [(QUICK if args.quick else FULL)[name] for name in args.models]
    if args.rounds:
        setups = [replace(s, rounds=args.rounds) for s in setups]
    if args.chunks:
        setups = [replace(s, chunks=tuple(args.chunks)) for s in setups]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    rounds: list[list[dict[Key, float]]] = [[] for _ in setups]
    for r in range(max(s.rounds for s in setups)):
        print(f"round {r + 1} ...", file=sys.stderr, flush=True)
        now = [i for i, s in enumerate(setups) if r < s.rounds]
        for i, seconds in zip(now, one_round([setups[i] for i in now], flip=r % 2 == 1)):
            rounds[i].append(seconds)
    printed = [tables(setup, per_round) for setup, per_round in zip(setups, rounds)]
    for text in printed:
        print(f"\n{text}", flush=True)
    print(f"\nload average now {os.getloadavg()[0]:.2f}", flush=True)
    if args.plot is not None:
        plot([panel for text in printed for panel in parse_fractions(text)], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
