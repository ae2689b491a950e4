"""Parameters tied across pipeline ranks (input and output embeddings on the first and last
stage): one copy per rank that uses it, kept equal, their gradients summed once per step.

:class:`TiedSync` makes the copies equal at the start and sums their gradients (their FSDP2
shards, with replicas) once after each backward: docs/engine-internals.md#tied-parameters.

Example::

    tied = TiedSync([(wte, group, 0)], timeout=60.0, board=board)
    tied.begin()       # before the step's actions (accumulated gradients set aside)
    ...                # the schedule runs, the replicas reduce
    tied.finish()      # wte.grad: the sum over both stages' uses, on both ranks
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from giantpipe.engine.distributed.faults import FailureBoard, wait_work
from giantpipe.engine.distributed.layout import Layout, tied_group
from giantpipe.engine.distributed.replicas import local_tensor
from giantpipe.engine.partition import set_aside_gradients

__all__ = ["TiedSync", "tied_copies"]


class TiedSync:
    """This rank's copies of tied parameters, each with the group of ranks holding that
    parameter and the rank of its first stage (the owner, whose value every copy takes)."""

    def __init__(
        self,
        held: Sequence[tuple[nn.Parameter, Any, int]],
        timeout: float,
        board: FailureBoard | None = None,
    ) -> None:
        self.held, self.timeout, self.board = list(held), timeout, board
        self.owned = {id(p) for p, _, owner in held if owner == dist.get_rank()}
        self._held: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for p, group, owner in self.held:
                work = dist.broadcast(local_tensor(p.data), src=owner, group=group, async_op=True)
                ranks = dist.get_process_group_ranks(group)
                wait_work(work, timeout, f"the broadcast of a tied parameter over {ranks}", board)

    def followers(self) -> list[nn.Parameter]:
        """The copies this rank holds but does not own: left out of the global norm."""
        return [p for p, _, _ in self.held if id(p) not in self.owned]

    def begin(self) -> None:
        """Before a step's actions: gradients of earlier steps are set aside (only this
        step's are summed), added back by :meth:`finish`."""
        self._held = set_aside_gradients(p for p, _, _ in self.held)

    def finish(self) -> None:
        """After the step's backward (and the replicas' reduce): each copy's gradient is the
        sum over every rank holding the parameter."""
        works = []
        for p, group, _ in self.held:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            works.append(
                (dist.all_reduce(local_tensor(grad), group=group, async_op=True), p, grad, group)
            )
        for work, p, grad, group in works:
            ranks = dist.get_process_group_ranks(group)
            what = f"the all-reduce of a tied parameter's gradient over ranks {ranks}"
            wait_work(work, self.timeout, what, self.board)
            held = self._held.pop(id(p), None)
            p.grad = grad if held is None else held.add_(grad)


def tied_copies(
    model: nn.Sequential,
    shared: Sequence[Sequence[tuple[int, str]]],
    layout: Layout,
    balance: Sequence[int],
    placement: Sequence[int],
    timeout: float,
    device: torch.device,
    board: FailureBoard | None = None,
) -> TiedSync:
    """This rank's copies of the parameters tied across pipeline ranks (``shared``, from
    ``partition.shared_parameters``), one per rank that uses it (a rank using it in several of
    its stages holds one object). Collective: every rank makes every tied group, in one order."""
    stage_of = [s for s, count in enumerate(balance) for _ in range(count)]
    held = []
    for places in shared:
        workers = sorted({placement[stage_of[i]] for i, _ in places})
        mine = [(i, n) for i, n in places if placement[stage_of[i]] == layout.worker]
        if len(workers) < 2:
            continue
        group = tied_group(layout, workers, timeout, device)
        if mine:
            param = model[mine[0][0]].get_parameter(mine[0][1])
            held.append((param, group, layout.replica * layout.workers + workers[0]))
    return TiedSync(held, timeout, board)
