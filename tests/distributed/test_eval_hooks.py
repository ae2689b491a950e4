"""A data's whole-model evaluation under torchrun (gloo ranks on loopback) runs through the
pipe: a user's hook written as for a plain model (a forward, then samples decoded through the
stages) gives the one-process run's figures, K = 2 with interleaved stages and K = 2 x R = 2
with FSDP2's ``full`` (where the samples decode in lockstep, a layer gathered at a time), while
no process holds any parameter besides its own stages' (its shards) as the hook runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.eval_hook_workers import run
from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed

WORLDS = {
    "K2_interleaved": (2, ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2"]),
    "K2xR2_full": (4, ["pipeline.replica_sharding=full"]),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("local")
    return run(tmp, [])


@pytest.mark.parametrize("name", list(WORLDS))
def test_a_users_hook_runs_through_the_pipe_as_in_one_process(
    name: str, one_process: dict, tmp_path: Path
) -> None:
    world, overrides = WORLDS[name]
    ranks = spawn(
        "tests.distributed.eval_hook_workers:run",
        world=world,
        tmp=tmp_path,
        timeout=300,
        overrides=["pipeline.executor=distributed", "pipeline.timeout=60", *overrides],
    )
    local = one_process["evals"]
    got = ranks[0]["evals"]
    assert [e["step"] for e in got] == [e["step"] for e in local] == [2, 4]
    for mine, theirs in zip(got, local, strict=True):
        assert mine["argmax_right"] == pytest.approx(theirs["argmax_right"])
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["sample_valid"] == pytest.approx(theirs["sample_valid"])
    assert ranks[0]["summary"]["eval/samples"] == one_process["summary"]["eval/samples"]
    for rank in ranks:  # while the hook ran: this process's stages (shards), nothing else
        assert len(rank["live"]) == 2 and all(live == rank["own"] for live in rank["live"])
        assert 0 < rank["own"] < one_process["own"]
    if world == 2:
        assert sum(r["own"] for r in ranks) == one_process["own"]
    else:  # FSDP2 full: the forward and the samples gathered one layer at a time
        assert all(0 < r["peak_gathered"] <= r["largest_layer"] for r in ranks), ranks
    assert one_process["live"] == [one_process["own"]] * 2  # one process: the whole model, once
