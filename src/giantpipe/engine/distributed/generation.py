"""The generation ring between ranks: a DistributedPipe's link for :mod:`giantpipe.engine.generate`.

:func:`generation_link` gives a pipe's ends of the ring (:class:`RankLink`: each message a
description in :mod:`.wire`'s words and then its bytes, on the host group; with R > 1 and
``full`` sharding the replicas decode in :class:`Lockstep`); :func:`from_last_stage` hands the
last stage's values (the ring's results, a forward's outputs) to every rank of the pipeline. The
messages, why they keep out of the transport's order, the lockstep:
docs/generation.md#between-ranks.

Example::

    link = generation_link(pipe, timeout=60.0)      # what pipe.generation_link(60.0) returns
    link.send(Message(0, hidden, stage=1)); message = link.receive(); link.finish()
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from giantpipe.engine.distributed.collectives import all_reduce_sum
from giantpipe.engine.distributed.faults import FailureBoard, wait_work
from giantpipe.engine.distributed.replicas import GatheredLink, ReplicaShards
from giantpipe.engine.distributed.wire import (
    DESCRIPTION_WORDS,
    Frame,
    description,
    encode,
    pack,
    unpack,
    words_left,
    words_of,
)
from giantpipe.engine.generate.decoding import Message, Tokens

__all__ = ["Lockstep", "RankLink", "from_last_stage", "generation_link"]

TAG = 23  # generation's messages, apart from training's transfers on the same pair of ranks
FIELDS = 4  # m, ghost, steps, stage; then the value's description
HOST = torch.device("cpu")


def flatten(message: Message) -> tuple[list[int], list[Tensor]]:
    """A message as its description's words (fields, then the value's) and tensors.

    >>> words, tensors = flatten(Message(2, torch.ones(3, 1), steps=8, stage=1))
    >>> words[:FIELDS], len(tensors)
    ([2, 0, 8, 1], 1)
    """
    value = message.value
    kind = 0 if value is None else 1 if isinstance(value, Tensor) else 2
    items = [] if value is None else [value] if kind == 1 else list(value)
    words, tensors = encode((kind, *items, message.order))
    return [message.m, int(message.ghost), message.steps, message.stage, *words], tensors


def unflatten(words: list[int], payload: Tensor) -> Message:
    """The message of a description's ``words`` whose tensors are views of ``payload``.

    >>> words, tensors = flatten(Message(0, (torch.ones(2), torch.zeros(2)), steps=4))
    >>> got = unflatten(words, pack(Frame.of(words[FIELDS:]), tensors))
    >>> [t.tolist() for t in got.value], got.order, got.steps
    ([[1.0, 1.0], [0.0, 0.0]], None, 4)
    """
    m, ghost, steps, stage = words[:FIELDS]
    kind, *items, order = unpack(Frame.of(words[FIELDS:]), payload)
    value = None if kind == 0 else items[0] if kind == 1 else tuple(items)
    return Message(m, value, order, steps, bool(ghost), stage)


def _max(value: int, group: Any, timeout: float, board: FailureBoard | None, what: str) -> int:
    total = torch.tensor([value], dtype=torch.int64)
    work = dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group, async_op=True)
    wait_work(work, timeout, f"the all-reduce of {what}", board)
    return int(total[0])


class Lockstep:
    """The replicas of a pipeline decoding together while each stage stays sharded over them
    (FSDP2's ``full``): a layer's all-gather is a collective of its R replicas, so every
    replica gathers the same layers in the same order. They serve the most micro-batches of
    any replica (``micro_batches``, over the world) and take a micro-batch's next step while
    any replica's goes on (``goes_on``, over the last stage's replicas); a replica with fewer
    walks the rest round the ring as ghosts, gathering without computing. ``hold``: a layer's
    unit gathered for the block, then freed (one layer whole at a time).

    Example::

        lockstep = Lockstep(pipe.shards, pipe.groups, 60.0, pipe.board)
        with lockstep.hold(layer): out, cache = layer.forward_cached(x, cache)
    """

    def __init__(
        self, shards: ReplicaShards, groups: Any, timeout: float, board: FailureBoard | None
    ) -> None:
        self.shards, self.groups, self.timeout, self.board = shards, groups, timeout, board

    def micro_batches(self, own: int) -> int:
        return _max(own, self.groups.control, self.timeout, self.board, "micro-batches to decode")

    def goes_on(self, going: bool) -> bool:
        group, what = self.groups.host_replica, "whether a micro-batch goes on decoding"
        return all_reduce_sum(float(going), group, self.timeout, self.board, what) > 0

    def hold(self, layer: nn.Module) -> AbstractContextManager[Any]:
        return self.shards.layer_gathered(layer)


class RankLink:
    """The ring between ranks, on a host (gloo) group: a message goes to the rank of
    ``message.stage`` (``ranks``: stage -> global rank). ``count`` and ``held`` (this rank's
    stages) are what :func:`~giantpipe.engine.generate.ring.serve_held_stages` reads;
    ``share_group``: the group of this rank's pipeline, over which the last stage's results
    reach every rank and its ranks agree on the micro-batches; ``lockstep``: the replicas'
    agreement with FSDP2's ``full`` (:class:`Lockstep`), else each pipeline on its own.

    A rank hears the ranks holding the stages before its own: one with one stage per rank or
    interleaved placement (the rank before), two under zb-v (the ranks on either side). With
    two, a description is taken from whichever sends first and the rest then from that rank:
    gloo keeps each sender's messages in order, so a description always meets one.

    Example::

        link = RankLink(pipe.groups.control, ranks=[0, 1, 0, 1], rank=0, timeout=60.0)
        link.send(Message(0, hidden, stage=1)); message = link.receive(); link.finish()
    """

    def __init__(
        self,
        group: Any,
        ranks: Sequence[int],
        rank: int,
        timeout: float,
        share_group: Any = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        self.group, self.ranks, self.timeout = group, list(ranks), timeout
        self.share_group, self.lockstep = share_group, lockstep
        self.count = len(self.ranks)
        self.held = [s for s, r in enumerate(self.ranks) if r == rank]
        senders = {self.ranks[s - 1] for s in self.held} - {rank}  # stage -1: the last one
        self.source: int | None = senders.pop() if len(senders) == 1 else None  # None: any
        self.sending: list[tuple[Any, list[Tensor]]] = []

    def send(self, message: Message) -> None:
        words, tensors = flatten(message)
        parts = description(words)
        frame = Frame.of(words[FIELDS:])
        if frame.nbytes:
            parts.append(pack(frame, tensors, HOST))
        dst = self.ranks[message.stage]
        works = [dist.isend(t, dst=dst, group=self.group, tag=TAG) for t in parts]
        self.sending = [s for s in self.sending if not all(w.is_completed() for w in s[0])]
        self.sending.append((works, parts))

    def _receive(self, buffer: Tensor, source: int | None) -> int:
        """Fills ``buffer`` from ``source`` (None: any rank); returns the sender's rank."""
        work = dist.irecv(buffer, src=source, group=self.group, tag=TAG)
        assert work is not None  # this rank is in the group
        work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        if source is not None:
            return source
        return dist.get_global_rank(self.group, work._source_rank())  # noqa: SLF001

    def receive(self) -> Message:
        head = torch.empty(DESCRIPTION_WORDS, dtype=torch.int64)
        sender = self._receive(head, self.source)
        rest = None
        if words_left(head):
            rest = torch.empty(words_left(head), dtype=torch.int64)
            self._receive(rest, sender)
        words = words_of(head, rest)
        payload = torch.empty(Frame.of(words[FIELDS:]).nbytes, dtype=torch.uint8)
        if payload.numel():
            self._receive(payload, sender)
        return unflatten(words, payload)

    def micro_batches(self, own: int) -> int:
        """The micro-batches every stage serves: stage 0's (``own`` there, 0 elsewhere), the
        most of any replica in lockstep."""
        if self.lockstep is not None:
            return self.lockstep.micro_batches(own)
        if self.share_group is None:
            return own
        return _max(own, self.share_group, self.timeout, None, "micro-batches to decode")

    def goes_on(self, going: bool) -> bool:
        return going if self.lockstep is None else self.lockstep.goes_on(going)

    def hold(self, layer: nn.Module) -> AbstractContextManager[Any]:
        return nullcontext() if self.lockstep is None else self.lockstep.hold(layer)

    def finish(self) -> None:
        """Waits until every message this rank sent is on its way."""
        for works, _ in self.sending:
            for work in works:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        self.sending.clear()

    def share(self, results: dict[int, Tokens]) -> dict[int, Tokens]:
        """The last stage's ``results`` on every rank of this rank's pipeline."""
        return dict(_broadcast(results, self.ranks[-1], self.share_group))


def _broadcast(value: Any, src: int, group: Any) -> Any:
    shared: list[Any] = [value]
    dist.broadcast_object_list(shared, src=src, group=group)
    return shared[0]


def _on_host(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.cpu()
    return tuple(_on_host(v) for v in value) if isinstance(value, tuple) else value


def from_last_stage(pipe: Any, value: Any) -> Any:
    """``value`` of the rank holding ``pipe``'s last stage (e.g. its forward's outputs) on
    every rank of its pipeline, tensors on the host (collective over the pipeline's host group;
    ignored elsewhere than the last stage).

    Example::

        outputs = from_last_stage(pipe, pipe(inputs))   # every rank: the last stage's outputs
    """
    layout = pipe.layout
    last = layout.rank_of_stage(layout.num_stages - 1)
    mine = _on_host(value) if layout.rank == last else None
    return _broadcast(mine, last, pipe.groups.host_pipeline)


def generation_link(pipe: Any, timeout: float) -> RankLink | GatheredLink:
    """``pipe``'s (a DistributedPipe's) ends of the generation ring: its stages' ranks on the
    control group, results shared over its pipeline's host group. With R > 1 (collective over
    the replicas): ``full`` decodes in :class:`Lockstep`, a layer gathered at a time; ``grads``
    gathers every FSDP2 unit until the link's ``finish``, and each replica decodes on its own.

    Example::

        out = generate(pipe, prompts, steps, decoding)    # calls pipe.generation_link(timeout)
    """
    layout, groups, shards = pipe.layout, pipe.groups, pipe.shards
    ranks = [layout.rank_of_stage(s) for s in range(layout.num_stages)]
    full = shards is not None and shards.mode == "full"
    lockstep = Lockstep(shards, groups, timeout, pipe.board) if full else None
    link = RankLink(groups.control, ranks, layout.rank, timeout, groups.host_pipeline, lockstep)
    if shards is None or full:
        return link
    shards.gather()
    return GatheredLink(link, shards.release)
