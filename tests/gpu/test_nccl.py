"""DistributedPipe over NCCL, one rank per GPU, equals the plain model (tests/gpu/nccl_world.py).

NCCL refuses two ranks on one GPU, so one GPU allows a world of one rank (K=1: the whole model
on one rank, its NCCL groups still built and used); two GPUs or more run K=2, one rank each,
with the transport whose device sends and receives are issued in one order on every rank
(``transport="ordered"``, which the CPU stand-ins force on gloo too). On CPU stand-ins both
worlds run on gloo ranks of this machine instead (the stand-in for NCCL the engine's tests use).
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

ROWS = [
    (world, rank, check)
    for world in (2, 1)
    for rank in range(world)
    for check in [*world_schedules(world)[:1], CLIP, *world_schedules(world)[1:]]
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
    record_property(
        "note",
        "K=1: the whole model on one rank (groups built, no step crosses ranks); M=4; "
        "DistributedPipe transport: 'ordered' (on the gloo stand-in too).",
    )
    if world == 2 and not opts.dry and opts.gpus < 2:
        not_here(
            record_property, TWO_GPUS, "K=2 over NCCL", "-", "NCCL refuses two ranks on one GPU"
        )
    rows = world_rows(opts, world)
    label = f"K={world} {backend}: {check} (rank {rank})"
    _, verdict, measured, criterion = rows.get(
        f"{check} (rank {rank})", rows.get(f"rank {rank}", (label, FAIL, "no row", ""))
    )
    if verdict not in (PASS, FAIL):
        not_here(record_property, verdict, label, measured, criterion)
    report(record_property, label, verdict == PASS, measured, criterion)
