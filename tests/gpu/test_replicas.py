"""K=2 pipeline ranks x R=2 replicas over NCCL, each stage on FSDP2 (four GPUs): one step per
sharding mode equals the plain model on the whole mini-batch.

Four GPUs, one rank each (NCCL refuses two ranks on one GPU): the smallest world where a stage
has replicas AND pipeline ranks exchange activations (K=1 x R=2 or K=2 x R=1 on two GPUs show
one or the other); with fewer the rows are skipped with that reason. CPU stand-ins
(``GIANTPIPE_GPU_STANDINS=1``) run the world on gloo ranks of this machine. Each rank judges
``full``, ``grads`` and ``none`` under 1f1b and zb-h1 (its split W: the reduce after the last
W), M=4: its loss and its whole gradients (the shards gathered) against the plain model
(replica 0's and replica 1's shards, each under its own dropout seeds), fp32; and, on GPUs,
``full`` with ``pipeline.precision=bf16``'s FSDP2 policy (parameters gathered in bf16,
gradients reduced in fp32) against the fp32 reference, within bf16's tolerance.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe.engine.batchnorm import convert_deferred_batch_norm
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.distributed.replicas import mixed_precision_policy, whole_tensor
from giantpipe.engine.meta import init_layers
from giantpipe.engine.rng import install_rng_hooks, mix
from giantpipe.perf.balance import even_balance
from giantpipe.testing import accumulate_micro_batches, step_seed
from giantpipe.testing.gpu import CUDA_ONLY, GpuOptions
from tests.gpu.case import Record, marks, not_here, report
from tests.gpu.errors import FP32_TOL, relative
from tests.gpu.mask_model import Sizes, mask_batch, mask_model, to
from tests.gpu.nccl_world import Row, run_world
from tests.gpu.steps import SEED

pytestmark = marks(300.0)

FOUR_GPUS = "needs 4 GPUs"
WORLD, K, CHUNKS, INIT = 4, 2, 4, 3
BF16_TOL = 2e-2
CASES = [(m, s) for m in ("full", "grads", "none") for s in ("1f1b", "zb-h1")] + [("bf16", "1f1b")]


def _shard(batch: Any, r: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tensor_split(2)[r]
    return tuple(_shard(t, r) for t in batch)


def _reference(sizes: Sizes, device: torch.device) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain model's step on both replicas' shards (each under its own dropout seeds, as
    the pipe seeds replica r), weighted by the whole batch: loss and gradients, on the host."""
    model = convert_deferred_batch_norm(mask_model(sizes)).to(device)
    init_layers(model, INIT)
    inputs, target = mask_batch(sizes)
    hooks, loss = install_rng_hooks(model), 0.0
    seed = step_seed(SEED)
    for r in range(2):
        losses = accumulate_micro_batches(
            model, to(_shard(inputs, r), device), _shard(target, r).to(device), CHUNKS,
            seed if r == 0 else mix(seed, r), total=float(sizes.batch),
            placement=[(len(model), device)],
        )  # fmt: skip
        loss += sum(float(x) for x in losses)
    for h in hooks:
        h.remove()
    return loss, {n: p.grad.cpu() for n, p in model.named_parameters()}


def replica_checks(tmp: Path, opts: GpuOptions) -> list[Row]:
    """On this rank of the K=2 x R=2 world (:func:`run_world`'s target; ``tmp`` unused): one
    step per case against the plain model."""
    sizes = Sizes.of(opts)
    device = (
        torch.device("cpu") if opts.dry else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    )
    ref_loss, ref_grads = _reference(sizes, device)
    inputs, target = mask_batch(sizes)
    rows = []
    for mode, schedule in CASES:
        label = f"{mode} {schedule}"  # run_world adds the rank
        if mode == "bf16" and opts.dry:
            rows.append((label, CUDA_ONLY, "-", "MixedPrecisionPolicy on GPUs"))
            continue
        policy = mixed_precision_policy("bf16", device) if mode == "bf16" else None
        pipe = DistributedPipe(lambda: mask_model(sizes), even_balance(sizes.blocks + 2, K),
                               chunks=CHUNKS, schedule=schedule,
                               recompute="except_last", device=device, seed=INIT,
                               deferred_batch_norm=True, timeout=60.0,
                               replica_sharding="full" if mode == "bf16" else mode,
                               mixed_precision=policy)  # fmt: skip
        torch.manual_seed(SEED)
        x, y = _shard(inputs, pipe.replica), _shard(target, pipe.replica)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = pipe.train_step(to(x, device) if pipe.needs_inputs else None,
                                   y.to(device) if pipe.needs_targets else None,
                                   nn.functional.cross_entropy)  # fmt: skip
        errs = {"loss": relative(loss.detach().cpu(), torch.tensor(ref_loss))}
        for name, p in pipe.named_parameters():  # gathered on every replica, in the same order
            errs[f"grad:{name}"] = relative(whole_tensor(p.grad).cpu(), ref_grads[name])
        name = max(errs, key=lambda n: errs[n])
        tol = BF16_TOL if mode == "bf16" else FP32_TOL
        verdict = "pass" if errs[name] <= tol else "FAIL"
        rows.append((label, verdict, f"{errs[name]:.1e} ({name})", f"relative error <= {tol}"))
        pipe.release()
    return rows


@cache
def world_rows(opts: GpuOptions) -> dict[str, Row]:
    """Every rank's rows of one run of the K=2 x R=2 world, by check."""
    rows = run_world("tests.gpu.test_replicas:replica_checks", WORLD, opts, timeout=240.0)
    return {row[0]: row for row in rows}


ROWS = [(m, s, r) for m, s in CASES for r in range(WORLD)]


@pytest.mark.parametrize(("mode", "schedule", "rank"), ROWS,
                         ids=[f"{m}-{s}-rank{r}" for m, s, r in ROWS])  # fmt: skip
def test_each_replica_rank_equals_the_plain_model(
    mode: str, schedule: str, rank: int, opts: GpuOptions, record_property: Record
) -> None:
    label = f"K=2 x R=2 FSDP2 {mode} {schedule} (rank {rank})"
    criterion = f"relative error <= {BF16_TOL if mode == 'bf16' else FP32_TOL}"
    if not opts.dry and opts.gpus < WORLD:
        not_here(record_property, FOUR_GPUS, label, "-", "NCCL refuses two ranks on one GPU")
    rows = world_rows(opts)
    _, verdict, measured, criterion = rows.get(
        f"{mode} {schedule} (rank {rank})",
        rows.get(f"rank {rank}", (label, "FAIL", "no row", criterion)),
    )
    if verdict not in ("pass", "FAIL"):
        not_here(record_property, verdict, label, measured, criterion)
    report(record_property, label, verdict == "pass", measured, criterion)
