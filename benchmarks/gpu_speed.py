"""The GPU check's throughput case: giantpipe against the plain model, torchgpipe and
torch.distributed.pipelining ("pippy") on the same GPU, as benchmarks/peers.py compares them on
CPU: the same MLP for every method, K=2, checkpoint never, medians of interleaved rounds.

On one GPU both stages share it (giantpipe: each worker on its own stream); a peer that cannot
be built or stepped is a failed row, not a lost case. Each ratio to a peer is judged by the floor
a GPU run set from its data (gpu_bands.py; "no band yet" until then).

Example::

    section = throughput(GpuOptions(dry=True, quick=True, gpus=0))
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from gpu_common import FAIL, INFO, Section
from gpu_perf import MLP, sync
from torch import nn

from giantpipe import GPipe
from giantpipe.perf.balance import even_balance
from giantpipe.testing.gpu import GpuOptions

PEERS = ("torchgpipe", "pippy", "plain-mb")  # giantpipe's speed is judged against each, 1 GPU
Methods = dict[str, Callable[[], Any]]


def timed(step: Callable[[], Any], steps: int, devices: list[torch.device]) -> float:
    """Seconds per step: a garbage collection and a warm-up step first, the kernels waited for."""
    gc.collect()
    step()
    sync(devices)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(devices)
    return (time.perf_counter() - start) / steps


def plain(mlp: MLP, device: torch.device) -> Methods:
    """The plain model on one device: the whole batch, and micro-batch by micro-batch."""
    model = mlp.model().to(device)
    x, y = mlp.batch_on(device)
    loss = nn.functional.mse_loss

    def accumulate() -> None:
        model.zero_grad()
        for xc, yc in zip(x.tensor_split(mlp.chunks), y.tensor_split(mlp.chunks)):
            (loss(model(xc), yc) / mlp.chunks).backward()

    def whole() -> None:
        model.zero_grad()
        loss(model(x), y).backward()

    return {"plain": whole, "plain-mb": accumulate}


def giantpipe(mlp: MLP, devices: list[torch.device], tag: str = "") -> Methods:
    """GPipe.train_step under gpipe and 1f1b, K=2 on ``devices``."""
    x, y = mlp.batch_on(devices[0])
    y = y.to(devices[-1])
    methods: Methods = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = GPipe(
            mlp.model(),
            even_balance(mlp.blocks, 2),
            devices=devices,
            chunks=mlp.chunks,
            checkpoint="never",
            schedule=schedule,
        )
        methods[f"giantpipe {schedule}{tag}"] = _step(pipe, x, y)
    return methods


def _step(pipe: GPipe, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    def step() -> None:
        pipe.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss)

    return step


def torchgpipe(mlp: MLP, devices: list[torch.device], tag: str = "") -> Methods:
    """torchgpipe 0.0.7's GPipe (the front door: forward, then the loss's backward)."""
    import torchgpipe as peer

    x, y = mlp.batch_on(devices[0])
    y = y.to(devices[-1])
    model = peer.GPipe(
        mlp.model(),
        even_balance(mlp.blocks, 2),
        devices=devices,
        chunks=mlp.chunks,
        checkpoint="never",
    )
    loss = nn.functional.mse_loss

    def step() -> None:
        model.zero_grad()
        loss(model(x), y).backward()

    return {f"torchgpipe{tag}": step}


def pippy(mlp: MLP, device: torch.device) -> Methods:
    """torch.distributed.pipelining with both stages in this process: a world of one rank, where
    looped BFS is its fill-drain for several stages per rank."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    model = mlp.model().to(device)
    half = mlp.blocks // 2
    stages: list[Any] = [
        PipelineStage(model[:half], 0, 2, device),
        PipelineStage(model[half:], 1, 2, device),
    ]
    schedule = ScheduleLoopedBFS(stages, n_microbatches=mlp.chunks, loss_fn=nn.functional.mse_loss)
    x, y = mlp.batch_on(device)

    def step() -> None:
        model.zero_grad()
        schedule.step(x, target=y)

    return {"pippy": step}


def build(opts: GpuOptions, mlp: MLP) -> tuple[Methods, dict[str, str]]:
    """Every method (and why any could not be built)."""
    one = opts.devices(1)[0]
    builders: list[tuple[str, Callable[[], Methods]]] = [
        ("plain", lambda: plain(mlp, one)),
        ("giantpipe gpipe", lambda: giantpipe(mlp, [one, one])),
        ("torchgpipe", lambda: torchgpipe(mlp, [one, one])),
        ("pippy", lambda: pippy(mlp, one)),
    ]
    if opts.gpus >= 2:
        two = opts.devices(2)
        builders.append(("giantpipe gpipe, 2 GPUs", lambda: giantpipe(mlp, two, ", 2 GPUs")))
        builders.append(("torchgpipe, 2 GPUs", lambda: torchgpipe(mlp, two, ", 2 GPUs")))
    methods: Methods = {}
    broken: dict[str, str] = {}
    for name, make in builders:
        try:
            methods.update(make())
        except Exception as exc:  # noqa: BLE001 - a failed row; the traceback goes to the log
            traceback.print_exc()
            broken[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    return methods, broken


def rounds(
    opts: GpuOptions, mlp: MLP, methods: Methods, broken: dict[str, str]
) -> dict[str, list[float]]:
    """Seconds per step of each method in each of ``mlp.rounds`` rounds that each time every
    method in turn; a method that raises is dropped (into ``broken``)."""
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(mlp.rounds):
        for name, step in list(methods.items()):
            try:
                seconds[name].append(timed(step, mlp.steps, opts.devices(2)))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                broken[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                del methods[name], seconds[name]
    return seconds


def ratio_row(
    section: Section,
    seconds: dict[str, list[float]],
    broken: dict[str, str],
    ours: str,
    peer: str,
    check: str,
    banded: bool = True,
) -> None:
    """``ours / peer`` in samples/s: the ratio of the medians, judged by a floor (``banded``),
    which a run proposes from its rounds' ratios; else printed only."""
    missing = [m for m in (ours, peer) if m not in seconds]
    if missing:
        why = "; ".join(f"{m}: {broken.get(m, 'not measured')}" for m in missing)
        section.add(check, FAIL, f"not measured ({why})", "-")
        return
    ratio = statistics.median(seconds[peer]) / statistics.median(seconds[ours])
    if not banded:
        section.add(check, INFO, f"{ratio:.2f}", "-")
        return
    each = [p / o for p, o in zip(seconds[peer], seconds[ours], strict=True)]
    section.banded(check, [ratio], f"{ratio:.2f} (rounds {min(each):.2f}-{max(each):.2f})",
                   "floor", seen=each)  # fmt: skip


def throughput(opts: GpuOptions) -> Section:
    """Samples/s of every method on the first GPU (and on two GPUs when there are two), and
    giantpipe's ratio to each."""
    mlp = MLP.of(opts)
    methods, broken = build(opts, mlp)
    seconds = rounds(opts, mlp, methods, broken)
    section = Section()
    for name, s in seconds.items():
        rate = mlp.batch / statistics.median(s)
        section.add(f"{name} samples/s", INFO, f"{rate:.1f}", f"median of {mlp.rounds} rounds")
    ours = "giantpipe gpipe"
    for peer in PEERS:
        ratio_row(section, seconds, broken, ours, peer, f"giantpipe / {peer}, one GPU")
    ratio_row(section, seconds, broken, ours, "plain", "giantpipe / plain", banded=False)
    if opts.gpus >= 2:
        two = ("giantpipe gpipe, 2 GPUs", "torchgpipe, 2 GPUs", "giantpipe / torchgpipe, 2 GPUs")
        ratio_row(section, seconds, broken, *two)
    section.notes.append(
        f"{mlp.blocks} x (Linear({mlp.width}) + ReLU), batch {mlp.batch}, M={mlp.chunks}, fp32, "
        f"checkpoint never, {mlp.steps} steps per round, methods interleaved in each round."
    )
    if opts.dry:
        section.notes.append("CPU stand-ins on shared cores: their ratios say nothing of a GPU.")
    return section
