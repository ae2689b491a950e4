"""Evaluation batches smaller than M through the distributed executor (issue 32, item 2): every
rank of a K=2 gloo world runs min(M, batch) micro-batches, the count stage 0's rank sees, and
the outputs and eval loss equal the plain model's; with one stage per rank and with virtual
stages (interleaved, V=2). A training step at M afterwards still equals the plain model's. With
K=2 x R=2 and FSDP2's full, replica shares of unequal size evaluate as the plain model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.eval_batch_workers import CHUNKS, SIZES
from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


def test_short_evaluation_batches_equal_the_plain_model(tmp_path: Path) -> None:
    calls = [
        ("gpipe", {}),
        ("interleaved", {"schedule": "interleaved", "virtual_stages": 2}),
    ]
    ranks = spawn(
        "tests.distributed.eval_batch_workers:several",
        world=2,
        tmp=tmp_path,
        timeout=150,
        calls=calls,
    )
    for name, _ in calls:
        counts = [rank[name]["counts"] for rank in ranks]
        assert counts[0] == counts[1] == [max(1, min(CHUNKS, n)) for n in SIZES], name
        assert all(rank[name]["checked"] > 0 for rank in ranks), name


def test_replica_shares_of_unequal_size_evaluate_as_the_plain_model(tmp_path: Path) -> None:
    """K = 2 x R = 2, ``full``: batches of 3, 1, 5 and 2 rows, halves of unequal size (one
    empty) that would run unequal numbers of micro-batches, each gathering every layer."""
    ranks = spawn("tests.distributed.eval_batch_workers:replica_shares", world=4, tmp=tmp_path)
    for rank in ranks:
        assert rank["got"] == pytest.approx(rank["plain"], rel=1e-6)
