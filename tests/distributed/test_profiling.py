"""torch.profiler under the distributed executor: each rank's plain ``torch.profiler.profile()``
records its stage's ops (``aten::addmm``), each inside its action's range."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_ranks_profiler_holds_its_stages_ops_in_their_actions(
    tmp_path: Path, schedule: str
) -> None:
    results = spawn(
        "tests.distributed.profiling_workers:profiled_step",
        world=2,
        tmp=tmp_path,
        schedule=schedule,
    )
    for rank, result in enumerate(results):
        stage = result["stage"]
        assert stage == rank
        linears = 1 + (stage == 1)  # stage 0: Linear, ReLU; stage 1: two Linears
        forwards = {f"giantpipe forward stage {stage} mb {m}": linears for m in (0, 1)}
        recomputed = {f"giantpipe backward stage {stage} mb 0": linears}  # except_last
        assert result["addmm"] == forwards | recomputed
        backwards = {f"giantpipe backward stage {stage} mb {m}" for m in (0, 1)}
        assert backwards <= set(result["ranges"])
