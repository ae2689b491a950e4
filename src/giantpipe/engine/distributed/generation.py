"""The generation ring between ranks: a DistributedPipe's link for
:mod:`giantpipe.engine.generate`, its messages in the wire format of :mod:`.wire`.

A message of the ring (:class:`~giantpipe.engine.generate.decoding.Message`) travels as the
description (:func:`~.wire.description`) of its fields (m, end, steps, stage) and of the value
``(kind, *tensors of the value, order)``, then the tensors' bytes as one message, on a host
(gloo) group under a tag of its own. Unlike a training step's transfers it does not follow an
order derived in advance (docs/engine.md, "Beyond one process", says why). Sends are
asynchronous (no cycle of blocked sends can form around the ring); receives wait at most
``timeout``.

Example::

    link = generation_link(pipe, timeout=60.0)      # what pipe.generation_link(60.0) returns
    link.send(Message(0, hidden, stage=1)); message = link.receive(); link.finish()
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

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

__all__ = ["RankLink", "generation_link"]

TAG = 23  # generation's messages, apart from training's transfers on the same pair of ranks
FIELDS = 4  # m, end, steps, stage; then the value's description
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
    return [message.m, int(message.end), message.steps, message.stage, *words], tensors


def unflatten(words: list[int], payload: Tensor) -> Message:
    """The message of a description's ``words`` whose tensors are views of ``payload``.

    >>> words, tensors = flatten(Message(0, (torch.ones(2), torch.zeros(2)), steps=4))
    >>> got = unflatten(words, pack(Frame.of(words[FIELDS:]), tensors))
    >>> [t.tolist() for t in got.value], got.order, got.steps
    ([[1.0, 1.0], [0.0, 0.0]], None, 4)
    """
    m, end, steps, stage = words[:FIELDS]
    kind, *items, order = unpack(Frame.of(words[FIELDS:]), payload)
    value = None if kind == 0 else items[0] if kind == 1 else tuple(items)
    return Message(m, value, order, steps, bool(end), stage)


class RankLink:
    """The ring between ranks, on a host (gloo) group: a message goes to the rank of
    ``message.stage`` (``ranks``: stage -> global rank). ``count`` and ``held`` (this rank's
    stages) are what :func:`~giantpipe.engine.generate.ring.serve_held_stages` reads;
    ``share_group``: the group of this rank's pipeline, over which the last stage's results
    reach every rank.

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
    ) -> None:
        self.group, self.ranks, self.timeout = group, list(ranks), timeout
        self.share_group = share_group
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

    def finish(self) -> None:
        """Waits until every message this rank sent is on its way."""
        for works, _ in self.sending:
            for work in works:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        self.sending.clear()

    def share(self, results: dict[int, Tokens]) -> dict[int, Tokens]:
        """The last stage's ``results`` on every rank of this rank's pipeline."""
        shared: list[Any] = [results]
        dist.broadcast_object_list(shared, src=self.ranks[-1], group=self.share_group)
        return dict(shared[0])


def generation_link(pipe: Any, timeout: float) -> RankLink:
    """``pipe``'s (a DistributedPipe's) ends of the generation ring: its stages' ranks on the
    control group, results shared over its pipeline's host group.

    Example::

        out = generate(pipe, prompts, steps, decoding)    # calls pipe.generation_link(timeout)
    """
    layout = pipe.layout
    ranks = [layout.rank_of_stage(s) for s in range(layout.num_stages)]
    return RankLink(pipe.groups.control, ranks, layout.rank, timeout, pipe.groups.host_pipeline)
