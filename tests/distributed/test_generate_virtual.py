"""Generation through a distributed pipe whose ranks hold several stages (gloo ranks on
loopback): the decode step goes round the ranks V times per token, and every rank gets the
tokens of the plain model's uncached reference decoders in one process, greedy and beam."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


def test_two_ranks_interleaved_equal_the_one_process_reference(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.generate_workers:translate",
        world=2,
        tmp=tmp_path,
        balance=[1, 2, 2, 1],
        schedule="interleaved",
        chunks=2,
        micro=3,
    )
    assert [r["stages"] for r in results] == [[0, 2], [1, 3]]
    for result in results:
        assert result["got"] == result["reference"]
    assert results[0]["held"] + results[1]["held"] == results[0]["total"]


def test_three_ranks_zb_v_hear_two_neighbours_and_equal_the_reference(tmp_path: Path) -> None:
    """zb-v with K = 3: rank 1 holds stages 1 and 4, fed by rank 0 and rank 2 in turn."""
    results = spawn(
        "tests.distributed.generate_workers:translate",
        world=3,
        tmp=tmp_path,
        timeout=180,
        balance=[1, 1, 1, 1, 1, 1],
        schedule="zb-v",
        chunks=3,
        micro=2,
    )
    assert [r["stages"] for r in results] == [[0, 5], [1, 4], [2, 3]]
    for result in results:
        assert result["got"] == result["reference"]
