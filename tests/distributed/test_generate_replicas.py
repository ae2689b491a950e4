"""Generation under replicas (gloo ranks on loopback, K = 2 stages x R = 2 replicas): with
FSDP2's ``full`` sharding the replicas decode in lockstep, each with prompts of its own (other
numbers of micro-batches, other lengths), and every rank gets the plain model's tokens in one
process (greedy and beam: the uncached reference decoders; sampling: the one-process draws)
while it never holds more than one layer's parameters gathered at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


def check_tokens(results: list[dict]) -> None:
    for result in results:
        assert result["got"] == result["reference"]
        assert result.get("sampled") == result.get("sampled_alone")
    assert results[0]["reference"] != results[-1]["reference"]  # the replicas' own prompts


def check_layer_at_a_time(results: list[dict]) -> None:
    for result in results:
        assert result["unshards"] > 0  # the layers were gathered, for each use
        assert 0 < result["peak"] <= result["largest_unit"] < result["stages_bytes"], result
        assert result["sharded_after"]


@pytest.mark.parametrize(
    "schedule, balance, lm_balance",
    [("gpipe", [3, 3], [2, 3]), ("interleaved", [1, 2, 2, 1], [1, 1, 1, 2])],
)
def test_full_sharding_decodes_a_layer_gathered_at_a_time(
    schedule: str, balance: list[int], lm_balance: list[int], tmp_path: Path
) -> None:
    results = spawn(
        "tests.distributed.replica_generation_workers:decode",
        world=4,
        tmp=tmp_path,
        timeout=240,
        balance=balance,
        schedule=schedule,
        lm_balance=lm_balance,
    )
    check_tokens(results)
    check_layer_at_a_time(results)


def test_zb_v_ranks_hearing_two_neighbours_keep_the_replicas_in_step(tmp_path: Path) -> None:
    """K = 3 x R = 2, zb-v: a middle rank holds stages 1 and 4, fed by the ranks on either side
    in whatever order their messages come; its replicas still gather in one order."""
    results = spawn(
        "tests.distributed.replica_generation_workers:decode",
        world=6,
        tmp=tmp_path,
        timeout=300,
        balance=[1, 1, 1, 1, 1, 1],
        schedule="zb-v",
    )
    check_tokens(results)
    check_layer_at_a_time(results)  # rank 0's tied embedding and head: one unit, gathered once


def test_grads_sharding_gathers_each_stage_once_and_each_replica_decodes_alone(
    tmp_path: Path,
) -> None:
    results = spawn(
        "tests.distributed.replica_generation_workers:decode",
        world=4,
        tmp=tmp_path,
        timeout=240,
        balance=[3, 3],
        sharding="grads",
        lm_balance=[2, 3],
    )
    check_tokens(results)
    for result in results:
        assert result["peak"] == result["stages_bytes"] and result["sharded_after"]
