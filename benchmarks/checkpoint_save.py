"""Checkpoint saves: how long the training step is blocked, trainer.async_save=true vs false.

    python benchmarks/checkpoint_save.py            # 1 GiB of fp32 weights + Adam: ~3-5 min
    python benchmarks/checkpoint_save.py --quick    # seconds; what the test suite runs

Model: Linear(8192, 8192) x 4 (1 GiB of fp32 weights) in a GPipe of K=2 CPU stand-ins, Adam
after one step (2 GiB more state): 3 GiB per save. Each round takes a training step, then saves
``last/`` through the runner's own
:class:`~giantpipe.runner.run_state.writer.CheckpointWriter`, once synchronously and once with
``async_save`` (interleaved rounds; this machine is shared and noisy, so medians; the first
asynchronous save also allocates the host buffers the later ones reuse), then one more training
step while the asynchronous write runs:

    blocked         what the step waits for: the whole save (sync), the copy to host memory (async)
    step            the next training step, during the background write (async) or after (sync)
    write left      what remained of the background write after that step (waited for)

Then the cost of the integrity check: sha256 over the bytes of one save, as a save computes it
on the bytes it writes and a load before it reads (each file read back and hashed). And the
storage itself, side by side at ~100 MB: today's DCP folder against the earlier format's one
``torch.save`` file per rank.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, seconds")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from giantpipe import GPipe
from giantpipe.checkpoint.files import atomic_save, describe
from giantpipe.runner.run_state.state import Progress
from giantpipe.runner.run_state.writer import CheckpointWriter
from giantpipe.runner.world import World


@dataclass(frozen=True)
class Setup:
    width: int
    layers: int
    batch: int
    rounds: int
    storage_mb: int


FULL = Setup(width=8192, layers=4, batch=8, rounds=5, storage_mb=100)
QUICK = Setup(width=256, layers=4, batch=8, rounds=2, storage_mb=4)


def build(setup: Setup) -> SimpleNamespace:
    """The parts of a run that a save reads (as the runner's Experiment holds them)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(setup.width, setup.width) for _ in range(setup.layers)))
    half = setup.layers // 2
    pipe = GPipe(model, [half, setup.layers - half], devices=["cpu", "cpu"], chunks=2)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)
    return SimpleNamespace(
        pipe=pipe,
        optimizer=optimizer,
        names=dict(model.named_parameters()),
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        ema=None,
        grad_scaler=None,
        batch=torch.randn(setup.batch, setup.width),
    )


def train_step(parts: SimpleNamespace) -> float:
    start = time.perf_counter()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.pipe.train_step(parts.batch, parts.batch, nn.functional.mse_loss)
    parts.optimizer.step()
    return time.perf_counter() - start


def state_bytes(parts: SimpleNamespace) -> int:
    tensors = list(parts.pipe.state_dict().values())
    tensors += [t for s in parts.optimizer.state.values() for t in s.values() if t.dim()]
    return sum(t.numel() * t.element_size() for t in tensors)


def save_round(parts: SimpleNamespace, folder: Path, step: int, writer: CheckpointWriter) -> dict:
    progress = Progress(step=step, position=step)
    start = time.perf_counter()
    writer.save(parts, progress, folder / "last")  # type: ignore[arg-type]
    blocked = time.perf_counter() - start
    step_s = train_step(parts)
    start = time.perf_counter()
    writer.wait()
    return {"blocked": blocked, "step": step_s, "left": time.perf_counter() - start}


def saves(setup: Setup, folder: Path) -> tuple[dict[str, dict[str, float]], SimpleNamespace, float]:
    """Median figures of each mode, the parts saved, and a step without a save."""
    parts = build(setup)
    train_step(parts)  # Adam's state exists from here on
    plain = statistics.median(train_step(parts) for _ in range(2))
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    # One writer per mode for the whole run, as a run has: the asynchronous one keeps its host
    # buffers from save to save (the first save allocates them).
    writers = {mode: CheckpointWriter(World(), asynchronous=mode == "async") for mode in runs}
    for rnd in range(setup.rounds):
        for mode, writer in writers.items():
            runs[mode].append(save_round(parts, folder / mode, rnd + 1, writer))
    table = {
        mode: {key: statistics.median(r[key] for r in rows) for key in ("blocked", "step", "left")}
        for mode, rows in runs.items()
    }
    return table, parts, plain


def hashing(parts: SimpleNamespace, folder: Path) -> tuple[float, float, int]:
    """Seconds of sha256 over the bytes a save writes (as a save hashes them, on their way to
    the file), seconds to check every file of the last synchronous save (read back and hashed,
    as a load does), and the bytes of that save."""
    tensors = list(parts.pipe.state_dict().values())
    tensors += [t for s in parts.optimizer.state.values() for t in s.values()]
    start = time.perf_counter()
    for tensor in tensors:
        hashlib.sha256(memoryview(tensor.detach().contiguous().numpy()).cast("B"))
    as_written = time.perf_counter() - start
    last = folder / "sync" / "last"
    files = [p.relative_to(last).as_posix() for p in last.rglob("*") if p.is_file()]
    start = time.perf_counter()
    describe(last, files)
    return as_written, time.perf_counter() - start, sum((last / f).stat().st_size for f in files)


def storage(setup: Setup, folder: Path) -> dict[str, dict[str, float]]:
    """Save and load of ~storage_mb MB: DCP (as checkpoints are now) vs one torch.save file."""
    side = int((setup.storage_mb * 2**20 / 4 / 8) ** 0.5)
    state = {f"{i}.weight": torch.randn(side, side) for i in range(8)}
    times: dict[str, dict[str, list[float]]] = {
        "dcp": {"save": [], "load": [], "bytes": []},
        "torch.save": {"save": [], "load": [], "bytes": []},
    }
    for rnd in range(setup.rounds):
        for kind, figures in times.items():
            where = folder / f"storage-{kind}-{rnd}"
            start = time.perf_counter()
            size = _save(kind, state, where)
            figures["save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            _load(kind, state, where)
            figures["load"].append(time.perf_counter() - start)
            figures["bytes"].append(size)
            shutil.rmtree(where, ignore_errors=True)
    return {k: {f: statistics.median(v) for f, v in fig.items()} for k, fig in times.items()}


def _save(kind: str, state: dict[str, torch.Tensor], where: Path) -> int:
    where.mkdir(parents=True)
    if kind == "dcp":
        writer = dcp.FileSystemWriter(where, sync_files=True, thread_count=1, overwrite=False)
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        atomic_save(state, where / "step000000001-000000-rank00000.pt")  # fsynced too
    return sum(p.stat().st_size for p in where.iterdir())


def _load(kind: str, state: dict[str, torch.Tensor], where: Path) -> None:
    if kind == "dcp":
        into = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(into, checkpoint_id=where, no_dist=True)
    else:
        loaded = torch.load(next(where.iterdir()), weights_only=True, mmap=True)
        {k: v.clone() for k, v in loaded.items()}


def report(setup: Setup, folder: Path) -> list[str]:
    table, parts, plain = saves(setup, folder)
    size = state_bytes(parts)
    hash_s, check_s, hashed = hashing(parts, folder)
    held = storage(setup, folder)
    sync, asyn = table["sync"], table["async"]
    lines = [
        f"## Checkpoint save: {setup.layers} x Linear({setup.width}, {setup.width}), Adam: "
        f"{size / 2**20:.1f} MiB per save; median of {setup.rounds} rounds; a step without a "
        f"save: {plain:.3f} s",
        "",
        "| save | blocked (s) | next step (s) | write left after it (s) | whole save (s) |",
        "|---|---|---|---|---|",
    ]
    for mode, row in table.items():
        whole = row["blocked"] + (row["step"] + row["left"] if mode == "async" else 0.0)
        lines.append(
            f"| {mode} | {row['blocked']:.3f} | {row['step']:.3f} | {row['left']:.3f} "
            f"| {whole:.3f} |"
        )
    lines += [
        "",
        f"blocked, async / sync: {asyn['blocked'] / sync['blocked']:.3f}",
        f"sha256 as a save writes its {size / 2**20:.1f} MiB: {hash_s:.3f} s "
        f"({size / hash_s / 2**30:.2f} GiB/s; {hash_s / sync['blocked']:.1%} of the sync save)",
        f"checking a save's {hashed / 2**20:.1f} MiB on load (read back, sha256): "
        f"{check_s:.3f} s ({hashed / check_s / 2**30:.2f} GiB/s)",
        "",
        f"## Storage, {setup.storage_mb} MB of fp32 weights (median of {setup.rounds})",
        "",
        "| storage | save (s) | load (s) | bytes |",
        "|---|---|---|---|",
    ]
    for kind, row in held.items():
        lines.append(f"| {kind} | {row['save']:.3f} | {row['load']:.3f} | {int(row['bytes'])} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup = QUICK if args.quick else FULL
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
    folder = Path(tempfile.mkdtemp(prefix="giantpipe-ckpt-bench-", dir=args.dir))
    try:
        print("\n".join(report(setup, folder)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
