"""The GPU check: one script, a few minutes on the GPUs a machine has, that says whether the
engine's GPU path is right and how fast it is.

    python benchmarks/gpu_check.py                 # on the visible GPUs (stages may share one)
    python benchmarks/gpu_check.py --cpu-dry-run   # the same checks on CPU stand-ins, tiny sizes
                                                   # (the test suite runs this, so it never rots)

For K = 2 and K = 4 stages (on the visible GPUs in turn; with one GPU every stage shares it):

1. transparency: a pipelined step (train_step, and the no_grad forward) against the plain model
   on the same device, fp32 and bf16 autocast: the loss, every gradient, the outputs;
2. speed: samples/s of GPipe.train_step against torchgpipe and the plain model (one device),
   M = 8, medians of interleaved rounds;
3. the simulator: GPipe.predict's step time and bubble against the measured ones;
4. memory: the peak per stage, from the allocator on CUDA (saved activations on CPU), and how
   the step's time is measured (CUDA events, or the host clock on CPU).

It prints markdown tables, and exits 1 when a transparency check fails.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from giantpipe import GPipe  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    width: int
    blocks: int
    batch: int
    chunks: int
    rounds: int
    steps: int


GPU = Sizes(width=4096, blocks=16, batch=1024, chunks=8, rounds=5, steps=10)
DRY = Sizes(width=32, blocks=8, batch=32, chunks=4, rounds=1, steps=1)


def model(sizes: Sizes) -> nn.Sequential:
    """Residual-free MLP blocks with LayerNorm: deep enough to cut into 4 stages."""
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(sizes.width, sizes.width), nn.LayerNorm(sizes.width), nn.GELU())
        for _ in range(sizes.blocks)
    ]
    return nn.Sequential(*layers)


def devices_for(k: int, dry: bool) -> list[str]:
    if dry:
        return ["cpu"] * k
    count = torch.cuda.device_count()
    return [f"cuda:{s % count}" for s in range(k)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pipe_of(net: nn.Sequential, k: int, sizes: Sizes, dry: bool) -> GPipe:
    per = len(net) // k
    balance = [per] * (k - 1) + [len(net) - per * (k - 1)]
    return GPipe(net, balance, devices=devices_for(k, dry), chunks=sizes.chunks, checkpoint="never")


# ---- 1. transparency -------------------------------------------------------------------------


def transparency(k: int, sizes: Sizes, dry: bool, precision: str) -> list[tuple[str, bool, float]]:
    """(check, passed, largest relative difference) of one pipeline against the plain model."""
    device = devices_for(1, dry)[0]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tol = 2e-2 if precision == "bf16" else 1e-4
    plain = model(sizes).to(device)
    piped = pipe_of(copy.deepcopy(plain).cpu(), k, sizes, dry)
    torch.manual_seed(1)
    x = torch.randn(sizes.batch, sizes.width)
    y = torch.randn(sizes.batch, sizes.width)
    loss_fn = nn.functional.mse_loss
    auto = torch.autocast(torch.device(device).type, dtype=dtype, enabled=precision == "bf16")
    with auto:
        expected = loss_fn(plain(x.to(device)), y.to(device))
    expected.backward()
    with auto:
        got = piped.train_step(x.to(piped.devices[0]), y.to(piped.devices[-1]), loss_fn)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    worst = max(_relative(p.grad, grads[n]) for n, p in piped.named_parameters())
    with torch.no_grad(), auto:
        out_plain, out_piped = plain(x.to(device)), piped(x.to(piped.devices[0]))
    forward = _relative(out_piped, out_plain)
    loss = _relative(got, expected)
    return [
        (f"K={k} {precision} loss", loss <= tol, loss),
        (f"K={k} {precision} gradients", worst <= tol, worst),
        (f"K={k} {precision} no_grad outputs", forward <= tol, forward),
    ]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# ---- 2. speed --------------------------------------------------------------------------------


def timed(step: Callable[[], None], steps: int) -> float:
    gc.collect()
    step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def speed(k: int, sizes: Sizes, dry: bool) -> dict[str, float]:
    """Median samples/s of the engine, torchgpipe and the plain model over interleaved rounds."""
    torch.manual_seed(1)
    first = devices_for(1, dry)[0]
    x, y = torch.randn(sizes.batch, sizes.width), torch.randn(sizes.batch, sizes.width)
    loss_fn = nn.functional.mse_loss
    pipe = pipe_of(model(sizes), k, sizes, dry)
    px, py = x.to(pipe.devices[0]), y.to(pipe.devices[-1])
    plain = model(sizes).to(first)
    methods: dict[str, Callable[[], None]] = {
        "giantpipe": lambda: (pipe.zero_grad(), pipe.train_step(px, py, loss_fn)),
        "plain (one device)": lambda: (
            plain.zero_grad(),
            loss_fn(plain(x.to(first)), y.to(first)).backward(),
        ),
    }
    peer = _torchgpipe(k, sizes, dry)
    if peer is not None:
        methods["torchgpipe"] = lambda: (peer.zero_grad(), loss_fn(peer(px), py).backward())
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(sizes.rounds):
        for name, step in methods.items():
            seconds[name].append(timed(step, sizes.steps))
    return {name: sizes.batch / statistics.median(s) for name, s in seconds.items()}


def _torchgpipe(k: int, sizes: Sizes, dry: bool) -> nn.Module | None:
    try:
        import torchgpipe
    except ImportError:
        return None
    net = model(sizes)
    per = len(net) // k
    balance = [per] * (k - 1) + [len(net) - per * (k - 1)]
    devices = devices_for(k, dry)
    return torchgpipe.GPipe(net, balance, devices=devices, chunks=sizes.chunks, checkpoint="never")  # type: ignore[no-any-return]


# ---- 3 and 4. the simulator and memory -------------------------------------------------------


def forecast_and_memory(k: int, sizes: Sizes, dry: bool) -> dict[str, object]:
    torch.manual_seed(1)
    pipe = pipe_of(model(sizes), k, sizes, dry)
    x = torch.randn(sizes.batch, sizes.width).to(pipe.devices[0])
    y = torch.randn(sizes.batch, sizes.width).to(pipe.devices[-1])
    loss_fn = nn.functional.mse_loss
    pipe.train_step(x, y, loss_fn)  # warm-up
    prediction = pipe.predict(x, y, loss_fn, repeats=3)
    walls, bubbles = [], []
    for _ in range(max(3, sizes.steps)):
        pipe.zero_grad()
        pipe.train_step(x, y, loss_fn)
        assert pipe.last_stats is not None
        walls.append(pipe.last_stats.wall_time_s)
        bubbles.append(pipe.last_stats.bubble)
    stats = pipe.last_stats
    assert stats is not None
    return {
        "predicted step s": prediction.step_time_s,
        "measured step s": statistics.median(walls),
        "measured / predicted": statistics.median(walls) / prediction.step_time_s,
        "predicted bubble": prediction.bubble,
        "measured bubble": statistics.median(bubbles),
        "busy s per stage": [round(b, 5) for b in stats.busy_time_s],
        "peak MiB per stage": [round(m / 2**20, 1) for m in stats.peak_memory_bytes],
        "memory measured as": stats.memory_kind,
        "time measured by": getattr(stats, "clock", "host clock"),
    }


# ---- the report ------------------------------------------------------------------------------


def environment(dry: bool) -> list[str]:
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}"]
    if dry:
        return [*lines, "dry run: CPU stand-in devices, tiny sizes"]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i}: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="CPU stand-ins, tiny sizes")
    args = parser.parse_args(argv)
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-dry-run", file=sys.stderr)
        return 2
    sizes = DRY if dry else GPU
    started = time.perf_counter()
    print("\n".join(environment(dry)))
    failed = 0
    for k in (2, 4):
        print(
            f"\n## K = {k}, M = {sizes.chunks}, {sizes.blocks} x Linear({sizes.width}), "
            f"batch {sizes.batch}\n"
        )
        print("| check | passed | largest relative difference |\n|---|---|---|")
        for precision in ("fp32", "bf16"):
            for name, passed, diff in transparency(k, sizes, dry, precision):
                failed += not passed
                print(f"| {name} | {'yes' if passed else 'NO'} | {diff:.2e} |")
        print("\n| method | samples/s |\n|---|---|")
        for name, rate in speed(k, sizes, dry).items():
            print(f"| {name} | {rate:.1f} |")
        print("\n| simulator and memory | value |\n|---|---|")
        for name, value in forecast_and_memory(k, sizes, dry).items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"| {name} | {shown} |")
    print(f"\n{time.perf_counter() - started:.0f} s; transparency failures: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
