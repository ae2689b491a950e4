"""The GPU check's distributed case: DistributedPipe over NCCL, one rank per GPU, against the
plain model.

NCCL refuses two ranks on one GPU, so one GPU allows a world of one rank (K=1: the whole model
on one rank, its NCCL groups still built and used); two GPUs or more run K=2, one rank each,
with the transport whose device sends and receives are issued in one order on every rank
(``transport="ordered"``, which the dry run forces on gloo too). A dry run runs both worlds
on gloo ranks of this machine instead (the stand-in for NCCL the engine's tests use).

Example::

    section = nccl(Options(dry=True, quick=True, gpus=0))
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_common import (
    CUDA_ONLY,
    FAIL,
    FP32_CRITERION,
    FP32_TOL,
    PASS,
    SEED,
    TWO_GPUS,
    Options,
    Outcome,
    Row,
    Section,
    Sizes,
    errors,
    even_balance,
    mask_batch,
    mask_model,
    plain_step,
    schedules,
    to,
    virtual_stages,
    worst,
)
from gpu_sync import cuda_syncs, host_reads, summarise
from torch import nn

from giantpipe.engine.dist.layout import init_distributed
from giantpipe.engine.dist.meta import init_layers
from giantpipe.engine.dist.pipe import DistributedPipe

INIT = 3  # DistributedPipe's layer initialisation seed; the reference is initialised alike
RANK_TIMEOUT = 60.0  # DistributedPipe(timeout=): a peer silent this long fails the step

SYNC_CRITERION = "no synchronising CUDA call (sync debug mode 'warn')"


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def world_checks(opts: Options, k: int) -> list[Row]:
    """On this rank: one step per schedule that runs on K=``k`` ranks, its loss (every rank)
    and its gradients and buffers (this rank's share) against the plain model; after the first,
    the global-norm clip watched for host synchronisation."""
    sizes = Sizes.of(opts)
    inputs, target = mask_batch(sizes)
    chunks = 2 * max(k, 2)
    device = (
        torch.device("cpu") if opts.dry else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    )
    model = mask_model(sizes)
    init_layers(model, INIT)  # as DistributedPipe(seed=INIT) initialises its layers
    ref = plain_step(model, inputs, target, chunks, [(len(model), device)])
    results: list[Row] = []
    for schedule in schedules():
        try:
            v = virtual_stages(schedule, k, chunks)
        except ValueError:
            continue  # a schedule that needs more ranks
        pipe = DistributedPipe(lambda: mask_model(sizes), even_balance(len(model), k * v),
                               chunks=chunks, schedule=schedule, virtual_stages=v,
                               recompute="except_last", device=device, seed=INIT,
                               deferred_batch_norm=True, timeout=RANK_TIMEOUT,
                               transport="ordered")  # fmt: skip
        torch.manual_seed(SEED)
        loss = pipe.train_step(to(inputs, device) if pipe.needs_inputs else None,
                               target.to(device) if pipe.needs_targets else None,
                               nn.functional.cross_entropy)  # fmt: skip
        results.append(_judge(schedule, pipe, loss, ref))
        if len(results) == 1:
            results.append(_clip_syncs(opts, pipe))
        pipe.release()
    return results


def _judge(schedule: str, pipe: DistributedPipe, loss: torch.Tensor, ref: Outcome) -> Row:
    grads = {n: p.grad.cpu() for n, p in pipe.named_parameters() if p.grad is not None}
    buffers = {n: b.cpu() for n, b in pipe.named_buffers()}
    mine = Outcome(
        ref.loss,
        {n: ref.grads[n] for n in dict(pipe.named_parameters())},
        {n: ref.buffers[n] for n in buffers},
    )
    name, err = worst(errors(Outcome(loss.detach().cpu(), grads, buffers), mine))
    return (schedule, PASS if err <= FP32_TOL else FAIL, f"{err:.1e} ({name})", FP32_CRITERION)


def _clip_syncs(opts: Options, pipe: DistributedPipe) -> Row:
    """``pipe.clip_grad_norm_`` (a collective over the pipeline's device group) watched: on
    CUDA no synchronising call; on CPU stand-ins its host reads listed."""
    check = "clip_grad_norm_ (host synchronisation)"
    with host_reads() if opts.dry else cuda_syncs() as seen:
        pipe.clip_grad_norm_(1.0)
    if opts.dry:
        return (check, CUDA_ONLY, "host reads: " + summarise(seen), SYNC_CRITERION)
    return (check, FAIL if seen else PASS, summarise(seen), SYNC_CRITERION)


def rank_main(rank: int, world: int, port: int, opts: Options, out: str) -> None:
    """One rank of a K=``world`` pipeline: joins the world, checks, writes its results."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    init_distributed()  # NCCL for device tensors on CUDA, gloo on CPU
    try:
        results: Any = world_checks(opts, world)
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        traceback.print_exc()  # into the case's log
        results = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_world(opts: Options, world: int, timeout: float) -> list[Row]:
    """Every rank's results for a world of ``world`` ranks (one rank: in this process)."""
    with tempfile.TemporaryDirectory() as out:
        if world == 1:
            rank_main(0, 1, free_port(), opts, out)
        else:
            # Fresh interpreters on GPUs (a forked CUDA runtime is unusable); a dry run forks,
            # before this process has computed anything (no OpenMP pool to inherit).
            ctx: Any = mp.get_context("fork" if opts.dry else "spawn")
            port = free_port()
            ranks = [
                ctx.Process(target=rank_main, args=(r, world, port, opts, out))
                for r in range(world)
            ]
            for p in ranks:
                p.start()
            deadline = time.monotonic() + timeout  # for the world, not for each rank in turn
            for p in ranks:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in ranks:
                if p.is_alive():
                    p.kill()
        return [result for r in range(world) for result in _read(Path(out, f"rank{r}.json"), r)]


def _read(path: Path, rank: int) -> list[Row]:
    if not path.exists():
        return [(f"rank {rank}", FAIL, "no result (crashed or timed out)", FP32_CRITERION)]
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        return [(f"rank {rank}", FAIL, data["error"], FP32_CRITERION)]
    return [(f"{check} (rank {rank})", verdict, measured, criterion)
            for check, verdict, measured, criterion in data]  # fmt: skip


def nccl(opts: Options) -> Section:
    """K=1 over NCCL on one GPU (all NCCL allows there); K=2 over NCCL on two GPUs."""
    section = Section()
    backend = "gloo stand-in" if opts.dry else "NCCL"
    if opts.dry or opts.gpus >= 2:
        for check, verdict, measured, criterion in run_world(opts, 2, timeout=RANK_TIMEOUT * 2):
            section.add(f"K=2 {backend}: {check}", verdict, measured, criterion)
    else:
        section.add("K=2 over NCCL", TWO_GPUS, "-", "NCCL refuses two ranks on one GPU")
    for check, verdict, measured, criterion in run_world(opts, 1, timeout=RANK_TIMEOUT):
        section.add(f"K=1 {backend}: {check}", verdict, measured, criterion)
    section.notes.append(
        "K=1: the whole model on one rank (groups built, no step crosses ranks); M=4; "
        "DistributedPipe transport: 'ordered' (on the gloo stand-in too)."
    )
    return section
