"""What each rank runs in the NCCL-order tests: real steps, every call to
``torch.distributed`` recorded, so that the test can replay them under NCCL's rule.

Example::

    results = spawn("tests.distributed.order_workers:recorded_steps", world=4, tmp=tmp_path,
                    workers=2, schedules=["1f1b"], chunks=[3])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.distributed.workers import equivalence
from tests.support.recording import recording


def recorded_steps(tmp: Path, workers: int, **kwargs: Any) -> dict[str, Any]:
    """The distributed equivalence check (loss and gradients equal the plain model's, with
    BatchNorm, dropout and an integer mask), every call recorded."""
    log: list[dict[str, Any]] = []
    with recording(log):
        result = equivalence(tmp, workers, **kwargs)
    return {"checked": result["checked"], "log": log, "rank": dist.get_rank()}
