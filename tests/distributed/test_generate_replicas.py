"""Generation under replicas (gloo ranks on loopback, K = 2 stages x R = 2 replicas): with
FSDP2's ``full`` sharding the replicas decode in lockstep, each with prompts of its own (other
numbers of micro-batches, other lengths), and every rank gets the plain model's tokens in one
process (greedy and beam: the uncached reference decoders; sampling: the one-process draws)
while it never holds more than one layer's parameters gathered at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launch import spawn

pytestmark = pytest.mark.distributed


def check_tokens(results: list[dict]) -> None:
    for result in results:
        assert result["got"] == result["reference"]
        assert result["sampled"] == result["sampled_alone"]
    assert results[0]["reference"] != results[2]["reference"]  # the replicas' own prompts


@pytest.mark.parametrize(
    "schedule, balance",
    [("gpipe", [3, 3]), ("interleaved", [1, 2, 2, 1])],
)
def test_full_sharding_decodes_a_layer_gathered_at_a_time(
    schedule: str, balance: list[int], tmp_path: Path
) -> None:
    results = spawn(
        "tests.distributed.replica_generation_workers:decode",
        world=4,
        tmp=tmp_path,
        timeout=240,
        balance=balance,
        schedule=schedule,
    )
    check_tokens(results)
    for result in results:
        assert result["unshards"] > 0  # the layers were gathered, for each use
        assert 0 < result["peak"] <= result["largest_layer"] < result["stages_bytes"], result
        assert result["sharded_after"]


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
    )
    check_tokens(results)
    for result in results:
        assert result["peak"] == result["stages_bytes"] and result["sharded_after"]
