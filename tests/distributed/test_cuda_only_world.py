"""The distributed pipe in a world whose default group takes no CPU tensor (issue 21).

On a GPU machine the world is NCCL's, and NCCL refuses CPU tensors ("No backend type associated
with device type cpu"). ``init_process_group("cuda:gloo")`` makes such a world on CPU: gloo
registered for the ``cuda`` device only. A pipe whose collectives inherit the world's backend
(the loss normaliser, the step statistics, clipping, the checkpoint's object collectives, the
runner's set-up) fails there at once; one whose groups name their backend trains, clips,
checkpoints and agrees with the plain model. K = 2 pipeline ranks, R = 1 and R = 2 replicas;
deferred BatchNorm and a weight tied between the first and the last stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [2, 4], ids=["K2_R1", "K2_R2"])
def test_a_world_that_takes_no_cpu_tensor(tmp_path: Path, world: int) -> None:
    results = spawn(
        "tests.distributed.gpu_rules_workers:train_round",
        world=world,
        tmp=tmp_path,
        timeout=120.0,
        backend="cuda:gloo",
        workers=2,
    )
    first = results[0]
    assert first["step"] == 2 and first["checked"] > 0
    for result in results[1:]:  # the loss and the norm are global: the same on every rank
        assert result["losses"] == first["losses"]
        assert result["norms"] == first["norms"]
