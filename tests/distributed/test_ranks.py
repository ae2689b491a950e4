"""The tests' rank launcher (tests/support/ranks.py): a failing world is reported by the rank
that failed first (the others mostly fail because of it), and a rank past its timeout is killed
and named, with the knob that lengthens the timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.support.ranks import spawn
from tests.timeouts import KNOB

pytestmark = pytest.mark.distributed


def fails_one_after_the_other(tmp: Path) -> None:
    """Rank 1 fails at once; rank 0 waits for it in a collective, which fails when rank 1 is
    gone, as a peer of a failed rank does."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke first")
    dist.barrier()


def one_rank_hangs(tmp: Path) -> int:
    if dist.get_rank() == 1:
        time.sleep(120)
    return dist.get_rank()


def test_the_rank_that_failed_first_is_the_failure(tmp_path: Path) -> None:
    target = "tests.distributed.test_ranks:fails_one_after_the_other"
    with pytest.raises(AssertionError) as failure:
        spawn(target, world=2, tmp=tmp_path, timeout=60)
    said = str(failure.value)
    assert said.startswith("rank 1 failed first:"), said
    assert "ValueError: rank 1 broke first" in said and "barrier" not in said


def test_a_rank_past_its_timeout_is_killed_and_named(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as failure:
        spawn("tests.distributed.test_ranks:one_rank_hangs", world=2, tmp=tmp_path, timeout=5)
    said = str(failure.value)
    assert "timeout: ranks [1] of tests.distributed.test_ranks:one_rank_hangs ran out" in said
    assert KNOB in said
    assert time.monotonic() - start < 60  # killed, not waited for
