"""What each rank runs in tests/distributed/test_faults.py's aborted-transfer test: a step over
the ordered transport whose payloads rank 1 treats as NCCL does, one of them aborted.

On CUDA the ordered transport only makes the stream wait for a payload receive (a wait without
a timeout) and checks the request after the step's device wait. With
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` the watchdog may abort a hung receive before then: the
stream goes on with a partly received buffer, and only the request knows (asked with a
timeout, it answers False). Here rank 1's mailbox takes the device path on gloo
(``_on_device``), and its payload receives answer as NCCL's would: the first one aborted.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from giantpipe.engine.distributed.faults import RankFailure
from giantpipe.engine.distributed.ordered import PAYLOADS, OrderedMailbox
from giantpipe.engine.distributed.pipe import DistributedPipe
from tests.timeouts import scaled


class LikeNccl:
    """A gloo receive that answers as an NCCL request does: a wait without a timeout (the
    stream's) waits for the bytes; a wait with one answers at once, False if ``aborted``."""

    def __init__(self, work: Any, aborted: bool) -> None:
        self.work, self.aborted = work, aborted

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            return bool(self.work.wait())
        return not self.aborted

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def aborted_receive(tmp: Path) -> dict[str, Any]:
    """One step of a K=2 pipe; rank 1's first payload receive is aborted after its stream
    wait. Returns what train_step raised on this rank (it must return nothing)."""
    rank = dist.get_rank()
    if rank == 1:
        real_irecv, seen = dist.irecv, []

        def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Any:
            work = real_irecv(tensor, src, group=group, tag=tag)
            if tag != PAYLOADS:
                return work
            seen.append(tag)
            return LikeNccl(work, aborted=len(seen) == 1)

        dist.irecv = irecv  # type: ignore[assignment]
        OrderedMailbox._on_device = lambda self: True  # type: ignore[method-assign]
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = DistributedPipe(model, [2, 1], chunks=2, timeout=scaled(10), transport="ordered")
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    returned: Any = "nothing"
    try:
        returned = pipe.train_step(x if rank == 0 else None, y if rank == 1 else None,
                                   nn.functional.cross_entropy)  # fmt: skip
    except RankFailure as exc:
        return {"raised": str(exc), "returned": returned}
    return {"raised": None, "returned": float(returned)}
