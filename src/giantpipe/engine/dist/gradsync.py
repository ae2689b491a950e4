"""Gradients across ranks: bucketed all-reduce over a stage's replicas, global-norm clipping.

**Replicas.** Each stage's gradients are summed over the R replicas of that stage (the loss is
already divided by the global batch, so a sum is the average). As in DDP, parameters are packed
into buckets in reverse order (backward reaches the last layers first) and a bucket's all-reduce
starts as soon as all its gradients are final, overlapping the rest of the backward::

    last backward of the stage  | ...layer 7 grads | layer 6 grads | ... | layer 4 grads |
    replica all-reduce          |                  [ bucket 0: 7, 6 ]    [ bucket 1: 5, 4 ]

"Final" = the parameter's gradient was accumulated once per micro-batch (a post-accumulate-grad
hook counts M); this does not depend on the schedule (GPipe, 1F1B, or W actions of zero-bubble).
Buckets start strictly in order, so every replica issues the same collectives in the same order
whatever its data; a bucket whose gradients never all become final (an unused parameter) is sent
when the step ends.

**Clipping.** :func:`clip_grad_norm_` takes the norm over every stage: local sums of squares,
all-reduced over the pipeline (replicas hold identical gradients after the all-reduce), on the
gradients' device and without a host sync.

**The rest of a step.** :func:`all_reduce_sum` sums one number over the replicas (the loss,
the loss normaliser), :func:`all_reduce_` a tensor (deferred BatchNorm statistics), and
:func:`all_gather_rows` gives every rank of a pipeline the step's statistics; all wait under the
pipe's timeout.

**Which group.** A tensor goes to a group that serves its device (see ``layout.Groups``):
gradients, BatchNorm statistics and the norm are device tensors, for ``groups.replica`` /
``groups.pipeline`` (NCCL on CUDA); numbers made on the host (:func:`all_reduce_sum`,
:func:`all_gather_rows`) are CPU tensors, for ``groups.host_replica`` / ``groups.host_pipeline``
(gloo).

Example::

    sync = GradientSync(pipe.named_parameters(), groups.replica, chunks=8, timeout=60.0)
    sync.begin()           # before the step's actions
    ...                    # the schedule runs; buckets start from inside autograd
    sync.finish()          # the remaining buckets, then wait and copy back into p.grad

fp16's scaler whose inf/NaN verdict every rank agrees on is :mod:`giantpipe.engine.fp16`'s
:class:`~giantpipe.engine.fp16.AgreedGradScaler`; its all-reduce is the pipe's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from giantpipe.engine.dist.faults import FailureBoard, wait_work
from giantpipe.engine.partition import set_aside_gradients


class GradientSync:
    """Sums the gradients of one rank's parameters over its replica group, bucket by bucket."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        group: Any,
        chunks: int,
        timeout: float,
        bucket_bytes: int = 25 * 2**20,
        overlap: bool = True,
        board: FailureBoard | None = None,
        uses: dict[int, int] | None = None,
    ) -> None:
        self.group, self.chunks, self.timeout = group, chunks, timeout
        self.uses = dict(uses or {})  # id -> stages of this rank that use it (tied: > 1)
        self.board, self.overlap = board, overlap
        params = [p for _, p in named_params if p.requires_grad]
        self.buckets = _buckets(params, bucket_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._counts: dict[int, int] = {}
        self._ready = [0] * len(self.buckets)
        self._next = 0  # buckets start in order: the next one to start
        self._works: list[tuple[Any, torch.Tensor]] = []
        self._late: list[str] = []
        self._held: dict[int, torch.Tensor] = {}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b
        ]
        self._names = {id(p): name for name, p in named_params}
        self.early = 0  # buckets of the last step started from inside the backward

    def begin(self) -> None:
        """Before a step's actions. Gradients already in ``p.grad`` (accumulation over several
        steps) are set aside: they are already summed, only this step's part is all-reduced."""
        self._held = set_aside_gradients(p for bucket in self.buckets for p in bucket)
        self.early = 0
        self._counts.clear()
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._works.clear()
        self._late.clear()

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.overlap:
            return
        count = self._counts.get(id(param), 0) + 1
        self._counts[id(param)] = count
        index = self._bucket_of[id(param)]
        if index < self._next:
            self._late.append(self._names.get(id(param), "a parameter"))
        elif count == self.chunks * self.uses.get(id(param), 1):
            self._ready[index] += 1
            while self._next < len(self.buckets) and self._ready[self._next] == len(
                self.buckets[self._next]
            ):
                self._start(self._next)
                self.early += 1

    def _start(self, index: int) -> None:
        bucket = self.buckets[index]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]
        )
        self._works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat))
        self._next = index + 1

    def finish(self) -> None:
        """Starts what is left, waits for every bucket and writes the sums into ``p.grad``."""
        if self._late:
            raise RuntimeError(
                f"{self._late[0]} received a gradient after its bucket was all-reduced (more "
                f"than {self.chunks} accumulations per step); use overlap=False"
            )
        while self._next < len(self.buckets):
            self._start(self._next)
        for index, (work, flat) in enumerate(self._works):
            wait_work(work, self.timeout, f"the all-reduce of gradient bucket {index}", self.board)
            offset = 0
            for p in self.buckets[index]:
                total = flat[offset : offset + p.numel()].view_as(p)
                held = self._held.pop(id(p), None)
                if held is not None:
                    p.grad = held.add_(total)
                elif p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)
                offset += p.numel()
        self._works.clear()

    def drop(self) -> None:
        """Forgets the all-reduces in flight and the group (after a failure)."""
        self._works.clear()
        self._held.clear()
        self.group = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Parameters in reverse order, cut into buckets of about ``bucket_bytes``, one dtype each."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        fits = buckets and size + nbytes <= bucket_bytes and buckets[-1][0].dtype == p.dtype
        if not fits:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | Any,
    max_norm: float,
    norm_type: float = 2.0,
    group: Any = None,
    uncounted: Iterable[torch.Tensor] = (),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Clips gradients by their norm over every stage of the pipeline; returns that norm.

    ``parameters`` are this rank's (``pipe.parameters()``; or pass the pipe itself, whose
    device pipeline group and device are then used). Equals ``torch.nn.utils.clip_grad_norm_``
    on the plain model. ``group`` must serve the gradients' device (NCCL on CUDA): the norm
    stays there, all-reduced as a device tensor, and the gradients are multiplied by a clamped
    coefficient tensor, so the host never waits for the device (no ``.item()``, no ``.cpu()``).
    ``device`` is where the norm lives when this rank has no gradient (default: the first
    parameter's device).

    Example::

        loss = pipe.train_step(x, y, loss_fn)
        norm = clip_grad_norm_(pipe, max_norm=1.0)     # a tensor on the pipe's device
        optimizer.step()
    """
    if hasattr(parameters, "groups") and hasattr(parameters, "parameters"):
        group = parameters.groups.pipeline if group is None else group
        uncounted = parameters.tied.followers() if hasattr(parameters, "tied") else uncounted
        device = getattr(parameters, "device", None) if device is None else device
        parameters = parameters.parameters()
    skip = {id(p) for p in uncounted}  # a tied copy's gradient: scaled, but counted once
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    scaled = grads + [p.grad for p in params if p.grad is not None and id(p) in skip]
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    local = _local_norm(grads, norm_type, torch.device(device))
    total = local.reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    norm = total[0] if inf else total[0].pow(1.0 / norm_type)
    # As torch's: a coefficient of exactly 1.0 under the limit leaves every gradient bit for bit.
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in scaled:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return norm.float()


def _local_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share of the norm in float64 on ``device``: the max (inf) or the sum of
    ``|g|^p`` over ``grads``; 0 with none."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    inf = norm_type == float("inf")
    norms = torch.stack(
        [(g.detach().abs().max() if inf else g.detach().norm(norm_type)).to(device) for g in grads]
    ).double()
    return norms.max() if inf else norms.pow(norm_type).sum()


class TiedSync:
    """Parameters tied across pipeline ranks (input and output embeddings on the first and last
    stage): each rank holds a copy; ``__init__`` makes the copies equal (the first stage's
    value), and each step their gradients are summed over the ranks that hold them, once,
    after the backward (not a 154 MB value per micro-batch through the pipeline). Every copy
    then takes the same optimizer step.

    ``held`` lists this rank's copies with the group of ranks holding that parameter and the
    rank of its first stage. Example::

        tied = TiedSync([(wte, group, 0)], timeout=60.0, board=board)
        tied.begin()       # before the step's actions (accumulated gradients set aside)
        ...                # the schedule runs
        tied.finish()      # wte.grad: the sum over both stages' uses, on both ranks
    """

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
                work = dist.broadcast(p.data, src=owner, group=group, async_op=True)
                ranks = dist.get_process_group_ranks(group)
                wait_work(work, timeout, f"the broadcast of a tied parameter over {ranks}", board)

    def followers(self) -> list[nn.Parameter]:
        """The copies this rank holds but does not own: left out of the global norm."""
        return [p for p, _, _ in self.held if id(p) not in self.owned]

    def begin(self) -> None:
        self._held = set_aside_gradients(p for p, _, _ in self.held)

    def finish(self) -> None:
        works = []
        for p, group, _ in self.held:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            works.append((dist.all_reduce(grad, group=group, async_op=True), p, grad, group))
        for work, p, grad, group in works:
            ranks = dist.get_process_group_ranks(group)
            what = f"the all-reduce of a tied parameter's gradient over ranks {ranks}"
            wait_work(work, self.timeout, what, self.board)
            held = self._held.pop(id(p), None)
            p.grad = grad if held is None else held.add_(grad)


def all_reduce_(
    tensor: torch.Tensor, group: Any, timeout: float, board: FailureBoard | None, what: str
) -> torch.Tensor:
    """Sums ``tensor`` in place over ``group``; a wait over ``timeout`` raises RankFailure
    naming ``what`` (e.g. "BatchNorm statistics") and the ranks.

    Example::

        all_reduce_(stats, groups.replica, 60.0, board, "BatchNorm statistics")
    """
    work = dist.all_reduce(tensor, group=group, async_op=True)
    ranks = dist.get_process_group_ranks(group)
    wait_work(work, timeout, f"the all-reduce of {what} over ranks {ranks}", board)
    return tensor


def all_reduce_sum(
    value: float, group: Any, timeout: float, board: FailureBoard | None, what: str
) -> float:
    """Sum of ``value`` over ``group`` (float64, so counts and losses stay exact); a CPU
    tensor, so ``group`` is a host group.

    Example::

        tokens = all_reduce_sum(local_tokens, groups.host_replica, 60.0, board, "tokens")
    """
    total = torch.tensor([value], dtype=torch.float64)
    return float(all_reduce_(total, group, timeout, board, what)[0])


def all_gather_rows(
    row: torch.Tensor, group: Any, ranks: list[int], timeout: float, board: FailureBoard | None
) -> torch.Tensor:
    """Every rank's ``row`` of the step's statistics, stacked in rank order (``ranks`` are
    the group's; with one rank, no collective). ``group`` serves ``row``'s device: a CPU row
    goes to a host group.

    Example::

        table = all_gather_rows(row, groups.host_pipeline, layout.pipeline_ranks, 60.0, board)
    """
    if len(ranks) == 1:
        return row.unsqueeze(0)
    rows = [torch.empty_like(row) for _ in ranks]
    work = dist.all_gather(rows, row, group=group, async_op=True)
    wait_work(work, timeout, f"the all-gather of step statistics over ranks {ranks}", board)
    return torch.stack(rows)
