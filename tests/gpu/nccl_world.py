"""A world of DistributedPipe ranks over NCCL, one rank per GPU, each checking its share of a
step against the plain model (what tests/gpu/test_nccl.py judges).

Two GPUs or more run K=2, one rank each (NCCL refuses two ranks on one GPU), with the one
transport, whose sends and receives every rank issues in one order. A dry run runs the world
on gloo ranks of this machine instead (the stand-in for NCCL the engine's tests use).

Example::

    rows = run_world(GpuOptions(dry=True, quick=True, gpus=0), 2, timeout=120.0)
    rows[0]   # ('gpipe (rank 0)', 'pass', '3.0e-08 (grad:1.fc.weight)', 'every tensor ...')
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from giantpipe.engine.distributed.layout import init_distributed
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.meta import init_layers
from giantpipe.perf.balance import even_balance
from giantpipe.testing import free_port, rank_env
from giantpipe.testing.gpu import CUDA_ONLY, GpuOptions
from tests.gpu.errors import FP32_CRITERION, FP32_TOL, errors, worst
from tests.gpu.mask_model import Sizes, mask_batch, mask_model, to
from tests.gpu.steps import SEED, Outcome, plain_step, schedules, virtual_stages
from tests.gpu.sync import cuda_syncs, host_reads, summarise

INIT = 3  # DistributedPipe's layer initialisation seed; the reference is initialised alike
RANK_TIMEOUT = 60.0  # DistributedPipe(timeout=): a peer silent this long fails the step

SYNC_CRITERION = "no synchronising CUDA call (sync debug mode 'warn')"
CLIP = "clip_grad_norm_ (host synchronisation)"
PASS, FAIL = "pass", "FAIL"

Row = tuple[str, str, str, str]  # check, verdict, measured, criterion


def chunks_of(k: int) -> int:
    """M for a world of ``k`` ranks."""
    return 2 * max(k, 2)


def world_schedules(k: int) -> list[str]:
    """The schedules a world of ``k`` ranks runs (one that needs more ranks is left out)."""
    out = []
    for schedule in schedules():
        try:
            virtual_stages(schedule, k, chunks_of(k))
        except ValueError:
            continue
        out.append(schedule)
    return out


def world_checks(opts: GpuOptions, k: int) -> list[Row]:
    """On this rank: one step per schedule that runs on K=``k`` ranks, its loss (every rank)
    and its gradients and buffers (this rank's share) against the plain model; after the first,
    the global-norm clip watched for host synchronisation."""
    sizes = Sizes.of(opts)
    inputs, target = mask_batch(sizes)
    chunks = chunks_of(k)
    device = (
        torch.device("cpu") if opts.dry else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    )
    model = mask_model(sizes)
    init_layers(model, INIT)  # as DistributedPipe(seed=INIT) initialises its layers
    ref = plain_step(model, inputs, target, chunks, [(len(model), device)])
    results: list[Row] = []
    for schedule in world_schedules(k):
        v = virtual_stages(schedule, k, chunks)
        pipe = DistributedPipe(lambda: mask_model(sizes), even_balance(len(model), k * v),
                               chunks=chunks, schedule=schedule, virtual_stages=v,
                               recompute="except_last", device=device, seed=INIT,
                               deferred_batch_norm=True, timeout=RANK_TIMEOUT)  # fmt: skip
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


def _clip_syncs(opts: GpuOptions, pipe: DistributedPipe) -> Row:
    """``pipe.clip_grad_norm_`` (a collective over the pipeline's device group) watched: on
    CUDA no synchronising call; on CPU stand-ins its host reads listed."""
    check = CLIP
    with host_reads() if opts.dry else cuda_syncs() as seen:
        pipe.clip_grad_norm_(1.0)
    if opts.dry:
        return (check, CUDA_ONLY, "host reads: " + summarise(seen), SYNC_CRITERION)
    return (check, FAIL if seen else PASS, summarise(seen), SYNC_CRITERION)


def rank_main(rank: int, world: int, port: int, opts: GpuOptions, out: str) -> None:
    """One rank of a K=``world`` pipeline: joins the world, checks, writes its results."""
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    init_distributed()  # NCCL for device tensors on CUDA, gloo on CPU
    try:
        results: Any = world_checks(opts, world)
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        traceback.print_exc()  # into the case's log
        results = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_world(opts: GpuOptions, world: int, timeout: float) -> list[Row]:
    """Every rank's results for a world of ``world`` ranks, each a process of its own."""
    with tempfile.TemporaryDirectory() as out:
        # Fresh interpreters on GPUs (a forked CUDA runtime is unusable); a dry run forks,
        # before this process has computed anything (no OpenMP pool to inherit).
        ctx: Any = mp.get_context("fork" if opts.dry else "spawn")
        port = free_port()
        ranks = [
            ctx.Process(target=rank_main, args=(r, world, port, opts, out)) for r in range(world)
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
