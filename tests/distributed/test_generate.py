"""Generation through the distributed pipe (gloo ranks on loopback): every rank gets the
tokens of the plain model's uncached reference decoder, greedy and beam, and holds only its
own stage's parameters; sampling equals the one-process figure; prompts of unequal length each
decode as alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


def test_two_ranks_two_micro_batches_greedy_and_beam_equal_the_reference(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.generate_workers:translate",
        world=2,
        tmp=tmp_path,
        balance=[3, 3],
        chunks=2,
    )
    for result in results:
        assert result["got"] == result["reference"]
        assert 0 < result["held"] < result["total"]  # its stage's weights only
    assert results[0]["held"] + results[1]["held"] == results[0]["total"]


def test_two_stages_times_two_replicas_each_decode_on_their_own(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.generate_workers:translate",
        world=4,
        tmp=tmp_path,
        timeout=180,
        balance=[3, 3],
        chunks=2,
    )
    for result in results:  # both pipelines (ranks 0-1 and 2-3) decode, neither waits on the other
        assert result["got"] == result["reference"]


def test_three_ranks_sampling_and_ragged_prompts_equal_one_process(tmp_path: Path) -> None:
    """Sampling equals the one-process draws; prompts of unequal length in one micro-batch
    (greedy and beam) each equal that prompt alone; the pipe's modes are left as found."""
    results = spawn(
        "tests.distributed.generate_workers:sample", world=3, tmp=tmp_path, balance=[2, 2, 1]
    )
    for result in results:
        assert result["got"] == result["alone"]
        assert result["ragged"]["got"] == result["ragged"]["alone"]
        assert result["modes_kept"]
