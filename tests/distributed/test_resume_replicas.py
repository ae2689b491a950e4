"""A resume with R >= 2 replicas continues exactly as the run that was not stopped.

Each step's dropout seed is drawn from the generator of every stage-0 rank (replica r mixes r
into it), so a resume that puts no generator state back fails here; the EMA and the data
position are restored on every rank too. Dropout 0.5 makes any other seed show in the losses.
(The replicas' generators stay in step, as only that draw advances them: restoring rank 0's
states on every rank would pass too, and is equivalent today.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("world", "stages"), [(2, 1), (4, 2)], ids=["K1xR2", "K2xR2"])
def test_resume_with_replicas_continues_exactly(tmp_path: Path, world: int, stages: int) -> None:
    results = spawn(
        "tests.distributed.resume_workers:resume_with_replicas",
        world=world,
        tmp=tmp_path,
        timeout=240.0,
        stages=stages,
        steps=4,
        resume_at=2,
    )
    run, resumed = results[0]["run"], results[0]["resumed"]
    assert len(run["train"]) == 4 and len(resumed["train"]) == 2
    assert resumed["train"] == run["train"][2:]  # exactly: same seeds, weights, batches
    assert resumed["eval"] == run["eval"]  # at step 4, on the EMA's weights
