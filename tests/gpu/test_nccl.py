"""DistributedPipe over NCCL, one rank per GPU, equals the plain model (tests/gpu/nccl_world.py).

Two GPUs or more run K=2, one rank each, with the one transport, whose sends and receives every
rank issues in one order (the same code on the gloo stand-in). NCCL refuses two ranks on one
GPU, and a world of one rank issues no NCCL operation that crosses ranks (it proved nothing,
yet passed): on one GPU every row is "needs 2 GPUs", and gpu_check reports the case "not run
(needs 2 GPUs)". On CPU stand-ins the world runs on gloo ranks of this machine instead (the
stand-in for NCCL the engine's tests use).
Each rank judges every schedule that runs on K ranks (M=4): its loss, and its share of the
gradients and buffers, fp32; after the first, the global-norm clip is watched for host
synchronisation. A world runs once; its rows are the tests below.
"""

from __future__ import annotations

from functools import cache

import pytest

from giantpipe.testing.gpu import TWO_GPUS, GpuOptions
from tests.gpu.case import Record, marks, not_here, report
from tests.gpu.nccl_world import CLIP, FAIL, PASS, RANK_TIMEOUT, Row, run_world, world_schedules

pytestmark = marks(240.0)

WORLD = 2  # ranks, one per GPU: the smallest world whose steps cross ranks over NCCL
ROWS = [
    (WORLD, rank, check)
    for rank in range(WORLD)
    for check in [*world_schedules(WORLD)[:1], CLIP, *world_schedules(WORLD)[1:]]
]


@cache
def world_rows(opts: GpuOptions, world: int) -> dict[str, Row]:
    """Every rank's rows of one run of a world of ``world`` ranks, by check."""
    rows = run_world(opts, world, timeout=RANK_TIMEOUT * world)
    return {row[0]: row for row in rows}


@pytest.mark.parametrize(
    ("world", "rank", "check"), ROWS, ids=[f"K={w}-rank{r}-{c.split()[0]}" for w, r, c in ROWS]
)
def test_each_rank_equals_the_plain_model(
    world: int, rank: int, check: str, opts: GpuOptions, record_property: Record
) -> None:
    backend = "gloo stand-in" if opts.dry else "NCCL"
    record_property("note", "DistributedPipe's one transport (the same on the gloo stand-in).")
    label = f"K={world} {backend}: {check} (rank {rank})"
    if not opts.dry and opts.gpus < world:
        why = "NCCL refuses two ranks on one GPU; a world of one sends nothing over NCCL"
        not_here(record_property, TWO_GPUS, label, "-", why)
    rows = world_rows(opts, world)
    _, verdict, measured, criterion = rows.get(
        f"{check} (rank {rank})", rows.get(f"rank {rank}", (label, FAIL, "no row", ""))
    )
    if verdict not in (PASS, FAIL):
        not_here(record_property, verdict, label, measured, criterion)
    report(record_property, label, verdict == PASS, measured, criterion)
