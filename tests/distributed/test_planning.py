"""pipeline.plan=auto under torchrun, K=2 x R=2 gloo ranks: every rank plans together, a model
built on meta is measured a layer at a time on rank 0 only, each rank times only its own link,
and the pipe takes the replica sharding the planner picked (the least sharded that fits)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


def test_every_rank_plans_together_by_share(tmp_path: Path) -> None:
    results = spawn("tests.distributed.planning_workers:plan_by_share", 4, tmp_path, timeout=300)
    first = results[0]
    for rank in results:  # one plan, rank 0's, everywhere
        assert rank["spec"] == first["spec"] and rank["choice"] == first["choice"]
    assert [r["made"] for r in results] == [4, 0, 0, 0]  # each layer made real once, on rank 0
    assert all(r["meta"] for r in results)  # the model itself stays on meta
    choice = first["choice"]
    assert 0 < choice["link_bandwidth_bytes_per_s"] < math.inf  # rank 0 to rank 1, over gloo
    assert (choice["replicas"], choice["replica_sharding"]) == (2, "none")  # 1 GiB: all fits
    assert choice["replica_sharding_why"] == "none (the least sharded mode) fits"
    for rank in results:  # the config said full; plan=auto took none, and the pipe runs it
        assert rank["status"] == "completed"
        assert rank["pipe_sharding"] == "none"
    assert results[0]["run_choice"]["replica_sharding"] == "none"
