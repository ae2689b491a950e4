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

import pytest

from giantpipe.testing.gpu import GpuOptions
from tests.gpu.case import Record, marks
from tests.gpu.nccl_world import ROWS, nccl_row

pytestmark = marks(240.0)


@pytest.mark.parametrize(
    ("world", "rank", "check"), ROWS, ids=[f"K={w}-rank{r}-{c.split()[0]}" for w, r, c in ROWS]
)
def test_each_rank_equals_the_plain_model(
    world: int, rank: int, check: str, opts: GpuOptions, record_property: Record
) -> None:
    nccl_row(world, rank, check, opts, record_property)
