"""Worlds of DistributedPipe ranks over NCCL, one rank per GPU, each rank checking its share
of a step against the plain model, and the rows tests/gpu/test_nccl.py reports from one.

The ranks start through tests/support/ranks.py (NCCL for GPU tensors, each rank on its GPU); a
dry run runs the world on gloo ranks of this machine instead (the stand-in for NCCL the engine's
tests use). Two GPUs or more run K=2, one rank each (NCCL refuses two ranks on one GPU), with
the one transport, whose sends and receives every rank issues in one order.

Example::

    opts = GpuOptions(dry=True, quick=True, gpus=0)
    rows = run_world("tests.gpu.nccl_world:world_checks", 2, opts, timeout=120.0)
    rows[0]   # ('gpipe (rank 0)', 'pass', '3.0e-08 (grad:1.fc.weight)', 'every tensor ...')
"""

from __future__ import annotations

import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.meta import init_layers
from giantpipe.perf.balance import even_balance
from giantpipe.testing.gpu import CUDA_ONLY, TWO_GPUS, GpuOptions
from tests.gpu.case import Record, not_here, report
from tests.gpu.errors import FP32_CRITERION, FP32_TOL, errors, worst
from tests.gpu.mask_model import Sizes, mask_batch, mask_model, to
from tests.gpu.steps import SEED, Outcome, plain_step, schedules, virtual_stages
from tests.gpu.sync import cuda_syncs, host_reads, summarise
from tests.support.ranks import rank_records, start_ranks, stop_ranks

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


def world_checks(tmp: Path, opts: GpuOptions) -> list[Row]:
    """On this rank of a world of K ranks (:func:`run_world`'s target; ``tmp`` unused): one
    step per schedule that runs on K ranks, its loss (every rank) and its gradients and buffers
    (this rank's share) against the plain model; after the first, the global-norm clip watched
    for host synchronisation."""
    k = dist.get_world_size()
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


def run_world(target: str, world: int, opts: GpuOptions, timeout: float) -> list[Row]:
    """Every rank's rows of ``target(tmp, opts=opts)`` run on ``world`` ranks, each check named
    with its rank; a rank that failed, or left nothing within ``timeout`` s for the world, is
    one FAIL row."""
    with tempfile.TemporaryDirectory() as out:
        # backend None: NCCL for GPU tensors and this rank's GPU made current, as the runner
        procs = start_ranks(target, world, Path(out), backend=None, opts=opts)
        stop_ranks(procs, timeout)
        records = rank_records(Path(out), world)
    return [row for r in range(world) for row in _rows(records.get(r), r)]


def _rows(record: dict[str, Any] | None, rank: int) -> list[Row]:
    if record is None:
        return [(f"rank {rank}", FAIL, "no result (crashed or timed out)", FP32_CRITERION)]
    if not record["ok"]:  # its traceback is in the case's log
        return [(f"rank {rank}", FAIL, record["what"][:200], FP32_CRITERION)]
    return [(f"{check} (rank {rank})", verdict, measured, criterion)
            for check, verdict, measured, criterion in record["result"]]  # fmt: skip


# -- tests/gpu/test_nccl.py's rows ------------------------------------------------------------

WORLD = 2  # ranks, one per GPU: the smallest world whose steps cross ranks over NCCL
ROWS = [
    (WORLD, rank, check)
    for rank in range(WORLD)
    for check in [*world_schedules(WORLD)[:1], CLIP, *world_schedules(WORLD)[1:]]
]
"""test_nccl's tests: (world, rank, check), the checks in the order a rank makes them."""


@cache
def world_rows(opts: GpuOptions, world: int) -> dict[str, Row]:
    """Every rank's rows of one run of a world of ``world`` ranks, by check."""
    rows = run_world("tests.gpu.nccl_world:world_checks", world, opts, RANK_TIMEOUT * world)
    return {row[0]: row for row in rows}


def nccl_row(world: int, rank: int, check: str, opts: GpuOptions, record: Record) -> None:
    """test_nccl's test of one row: ``check`` on ``rank`` of a world of ``world`` ranks, judged
    from the world's one run; skipped as "needs 2 GPUs" where there are fewer GPUs than ranks
    (NCCL refuses two ranks on one GPU, and a world of one sends nothing over NCCL)."""
    backend = "gloo stand-in" if opts.dry else "NCCL"
    record("note", "DistributedPipe's one transport (the same on the gloo stand-in).")
    label = f"K={world} {backend}: {check} (rank {rank})"
    if not opts.dry and opts.gpus < world:
        why = "NCCL refuses two ranks on one GPU; a world of one sends nothing over NCCL"
        not_here(record, TWO_GPUS, label, "-", why)
    rows = world_rows(opts, world)
    _, verdict, measured, criterion = rows.get(
        f"{check} (rank {rank})", rows.get(f"rank {rank}", (label, FAIL, "no row", ""))
    )
    if verdict not in (PASS, FAIL):
        not_here(record, verdict, label, measured, criterion)
    report(record, label, verdict == PASS, measured, criterion)
