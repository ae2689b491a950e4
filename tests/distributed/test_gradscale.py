"""fp16 loss scaling under the distributed executor: one inf/NaN verdict for every rank.

An inf in ONE rank's gradients (one stage of one replica) must make every rank skip the step
and halve its scale; torch's own scaler (which sees one rank's gradients) is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("world", "workers", "bad_rank"), [(2, 2, 1), (4, 2, 2)])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(
    tmp_path: Path, world: int, workers: int, bad_rank: int
) -> None:
    results = spawn(
        "tests.distributed.gradscale_workers:agreement",
        world=world,
        tmp=tmp_path,
        workers=workers,
        bad_rank=bad_rank,
    )
    for rank, result in enumerate(results):
        assert "pipe.grad_scaler()" in result["refused"], rank
        # 2**10 grows to 2**11 after a clean step, halves on the overflow, grows again.
        assert result["scales"] == [2048.0, 1024.0, 2048.0], rank
        assert result["moved"] == [True, False, True], rank
    for rank in range(workers, world):  # a replica holds the same stage as rank - K
        replica, first = results[rank]["weights"], results[rank - workers]["weights"]
        assert replica.keys() == first.keys()
        for name, weight in replica.items():
            assert torch.equal(weight, first[name]), f"rank {rank} {name}"


def test_the_runner_in_fp16_under_the_distributed_executor(tmp_path: Path) -> None:
    """pipeline.precision=fp16 with pipeline.executor=distributed: each rank's runner steps
    through an agreeing scaler (torch's own would be refused) and saves the same scale."""
    results = spawn(
        "tests.distributed.gradscale_workers:runner_fp16", world=2, tmp=tmp_path, steps=2
    )
    for rank, result in enumerate(results):
        summary = result["summary"]
        assert summary["status"] == "completed" and summary["steps"] == 2, rank
        assert summary["train/loss_scale"] > 0, rank
        saved = result["saved"]
        assert len(saved) == 2 and saved[0] == saved[1], rank  # one state file per rank
        assert saved[0]["scale"] == summary["train/loss_scale"], rank
