"""The executor's mailbox, stretched across processes with point-to-point messages.

One concept, one class: :class:`P2PMailbox` and the plan of what it receives from whom (its
section dividers group its methods: sending, receiving, the end of a step).

The local executor hands values between stages through a :class:`Mailbox` keyed
``("act", stage, m)`` / ``("grad", stage, m)``. :class:`P2PMailbox` keeps that interface, so the
very same ``StepRun`` drives one rank of a distributed pipeline:

- ``put`` of a key whose consumer stage lives on another rank is an asynchronous send
  (``isend``) of one message, the value's *frame*
  (:mod:`giantpipe.engine.distributed.wire`): the rank computes on while the bytes travel;
- the schedule says which keys each peer sends this rank and in which order, and every key's
  frame size is known from the step before, so receives are posted ahead, in the peer's order,
  into buffers of exactly that size; ``get`` waits for its key's message and returns views of
  its buffer::

      rank 0 | F0 isend(act1,0)    F1 isend(act1,1)    F2 ...
      rank 1 | irecv(act1,0) irecv(act1,1) | get(act1,0): irecv(act1,2..) while waiting | F0 ...
               (posted at the start)         (time spent waiting anyway)

  Gloo moves a message only once both ends have posted it; with the receive posted first, the
  sender's ``isend`` writes the bytes at once and no round trip is left on the critical path.
  ``start`` posts the first ``POSTED_AT_START`` receives per peer and ``get`` posts the rest
  while the message it waits for is not in yet, one at a time: a receive costs the rank tens to
  hundreds of microseconds (a wake-up of gloo's thread on a busy core), and posting a step's
  worth at its start would delay stage 0's first forward, and so the whole pipeline, by
  milliseconds at M=16.
- the first time a key travels, or when its layout changed, the sender announces the layout in
  the message the receiver posted (a header fits any receive buffer) and sends the frame on the
  follow-up tag; the receiver learns the layout, posts that frame's receive, and later steps
  are one message again. Both ends keep the layouts in :class:`KnownLayouts` across steps.

Everything runs on the rank's main thread (gloo's own I/O thread moves the bytes): no Python
thread hand-offs, which on a loaded machine cost milliseconds each. Messages from a peer are
taken in the order the peer sent them and a rank only ever waits for messages its peer has
already committed to sending before the one it needs, so under gloo's matching by peer and tag
it cannot deadlock. It is the gloo transport: under NCCL, where a pair's operations run in issue
order, its receives posted ahead would hold up the rank's own sends (even with ``ahead=1``, one
per peer); the device transport is :mod:`giantpipe.engine.distributed.ordered`, which also carries a
``P2PMailbox`` of its own for the descriptions of values, on a host group.

A receive that fails names its peer: a closed connection ("rank 1 (stage 1) is gone"), or a wait
longer than ``timeout`` ("rank 0 (stage 0) timed out after 60s waiting for the gradient of
micro-batch 3 from rank 1 (stage 1)"); it is reported on the failure board and raised as
:class:`~giantpipe.engine.distributed.faults.RankFailure`.

Example (on each rank, inside a process group; ``known`` lives as long as the pipe)::

    box = P2PMailbox(layout, groups.p2p, timeout=60.0, board=board, seed=seed_or_None,
                     known=known)
    box.start(schedule.actions)          # every worker's actions: who sends this rank what
    run = StepRun(config, micro_batches if layout.needs_inputs else [], mailbox=box)
    run.run(my_schedule)
    box.finish()   # this step's sends are through
"""

from __future__ import annotations

import datetime
import functools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.engine.distributed.faults import FailureBoard, RankFailure, explain, wait_work
from giantpipe.engine.distributed.layout import Layout
from giantpipe.engine.distributed.wire import (
    HEADER_BYTES,
    Frame,
    KnownLayouts,
    encode,
    extra_words,
    header,
    pack,
    prefix_of,
    unpack,
    words_of,
)
from giantpipe.engine.mailbox import Key, Mailbox
from giantpipe.engine.schedules.actions import Action

FRAMES, FOLLOW_UPS = 0, 1  # tags: frames posted ahead; an announcement's extra words and frame
# Receives per peer kept posted ahead however busy the rank is: the next message can land while
# the rank computes (the rest are posted while it waits, see the module docstring).
POSTED_AT_START = 2


def filling(head: torch.Tensor, size: int) -> torch.Tensor:
    """``head``'s bytes at the start of a zeroed message of exactly ``size`` bytes: the size of
    the receive the peer posted for it (NCCL, unlike gloo, needs a send and its receive to
    match in size and type; a header fits any frame, which starts with one).

    >>> filling(torch.ones(2, dtype=torch.int64), 24).tolist()[:9]
    [1, 0, 0, 0, 0, 0, 0, 0, 1]
    """
    message = torch.zeros(size, dtype=torch.uint8)
    raw = head.contiguous().view(torch.uint8)
    message[: raw.numel()] = raw
    return message


def describe(key: Key) -> str:
    kind, _, m = key
    return f"the {'activation' if kind == 'act' else 'gradient'} of micro-batch {m}"


def wait_receive(
    work: Any, key: Key, layout: Layout, timeout: float, board: FailureBoard | None
) -> None:
    """Waits (host) for the receive of ``key``; a failure raises RankFailure naming the peer:
    it timed out, its connection closed, it was aborted, or what the backend said. Both
    mailboxes' receives.

    Example::

        wait_receive(work, ("act", 1, 0), layout, 60.0, board)
    """
    stage = key[1] - 1 if key[0] == "act" else key[1] + 1
    me, them = layout.label(), layout.label(stage)
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - becomes a message naming the peer
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Timed out" in text:
            local = f"{me} timed out after {timeout:.0f}s waiting for {describe(key)} from {them}"
        elif "closed" in text.lower() or "reset" in text.lower():
            local = f"{them} is gone (connection closed); {me} waited for {describe(key)}"
        else:
            local = f"{me} failed to receive {describe(key)} from {them}: {text}"
        raise RankFailure(explain(board, local)) from exc
    if done is False:  # aborted (see faults.wait_work): the buffer is not the message
        local = f"{me}: the receive of {describe(key)} from {them} was aborted"
        raise RankFailure(explain(board, local))


def expected_receives(actions: Sequence[Action], layout: Layout) -> dict[int, list[Key]]:
    """Keys this rank receives from each peer rank, in the order its actions consume them."""
    last = layout.num_stages - 1
    by_peer: dict[int, list[Key]] = {}
    for kind, stage, m in actions:
        if kind == "F" and stage > 0:
            key, producer = ("act", stage, m), stage - 1
        elif kind == "B" and stage < last:
            key, producer = ("grad", stage, m), stage + 1
        else:
            continue
        peer = layout.rank_of_stage(producer)
        if peer != layout.rank:
            by_peer.setdefault(peer, []).append(key)
    return by_peer


def sends_to(actions: Sequence[Action], layout: Layout, dst: int) -> list[Key]:
    """Keys that one worker's ``actions`` send to rank ``dst`` (of this replica), in order.

    Example::

        >>> from giantpipe.engine.schedules import build_schedule
        >>> plan = build_schedule("1f1b", 2, 2)
        >>> sends_to(plan.actions[1], Layout(2, 0, 2, plan.placement), dst=0)
        [('grad', 0, 0), ('grad', 0, 1)]
    """
    last = layout.num_stages - 1
    keys: list[Key] = []
    for kind, stage, m in actions:
        if kind == "F" and stage < last:
            key: Key = ("act", stage + 1, m)
        elif kind == "B" and stage > 0:
            key = ("grad", stage - 1, m)
        else:
            continue
        local = layout.placement[stage] == layout.placement[key[1]]
        if not local and layout.rank_of_stage(key[1]) == dst:
            keys.append(key)
    return keys


@functools.lru_cache(maxsize=64)
def receive_plan(
    actions: tuple[tuple[Action, ...], ...], layout: Layout
) -> tuple[tuple[int, tuple[Key, ...]], ...]:
    """``(peer, keys in the peer's sending order)`` for each rank that sends this one values
    in a step of ``actions`` (every worker's); checked against the order this rank consumes
    them in. Cached: a pipe runs the same schedule step after step.

    Example::

        >>> from giantpipe.engine.schedules import build_schedule
        >>> plan = build_schedule("1f1b", 2, 2)
        >>> receive_plan(plan.actions, Layout(2, 1, 2, plan.placement))
        ((0, (('act', 1, 0), ('act', 1, 1))),)
    """
    plan = []
    for peer, keys in expected_receives(actions[layout.worker], layout).items():
        order = sends_to(actions[peer % layout.workers], layout, layout.rank)
        if sorted(order) != sorted(keys):
            raise RuntimeError(f"{layout.label()}: rank {peer} sends {order}, not {keys}")
        plan.append((peer, tuple(order)))
    return tuple(plan)


@dataclass
class _Posted:
    """A receive posted for ``key``: a frame of the known layout, or (first time) a header."""

    key: Key
    buffer: torch.Tensor
    work: Any
    frame: Frame | None


@dataclass
class _Stream:
    """Messages from one peer in this step: the keys in the peer's order, the receives posted."""

    peer: int
    order: list[Key]
    posted: deque[_Posted] = field(default_factory=deque)
    next: int = 0  # index in ``order`` of the next receive to post


@dataclass
class _Arrived:
    """A value whose message is in; after an announcement its frame may still be on its way."""

    value: Any
    follow_up: _Posted | None = None


class P2PMailbox(Mailbox):
    """A mailbox whose producers and consumers may be other ranks (one step's worth).

    ``seed`` is the step's seed where this rank draws it (it holds stage 0); elsewhere it is
    None until the first message brings it, and ``on_seed`` is told (before the action that
    needs it runs). ``known`` carries the frame layouts from step to step; ``ahead`` is the most
    receives per peer pending at once (None: up to all of the step's, posted while waiting).
    """

    def __init__(
        self,
        layout: Layout,
        group: Any,
        timeout: float,
        board: FailureBoard | None = None,
        comm_device: torch.device | None = None,
        seed: int | None = None,
        on_seed: Callable[[int], None] | None = None,
        known: KnownLayouts | None = None,
        ahead: int | None = None,
    ) -> None:
        super().__init__(timeout)
        self.layout, self.group, self.wait_timeout, self.board = layout, group, timeout, board
        self.comm_device = comm_device or torch.device("cpu")
        self.seed, self.on_seed = seed, on_seed
        self.known = known if known is not None else KnownLayouts()
        self.ahead = ahead
        self._streams: dict[int, _Stream] = {}
        self._source: dict[Key, int] = {}  # remote keys still to be got -> the peer sending it
        self._arrived: dict[Key, _Arrived] = {}
        self._sends: list[tuple[Key, list[Any], list[torch.Tensor]]] = []

    # ---- sending ---------------------------------------------------------------------------

    def consumed_here(self, key: Key) -> bool:
        return self.layout.rank_of_stage(key[1]) == self.layout.rank

    def put(self, key: Key, value: Any) -> None:
        dst = self.layout.rank_of_stage(key[1])
        if dst == self.layout.rank:
            super().put(key, value)
            return
        if self.seed is None:
            raise RuntimeError(f"{self.layout.label()} sends before knowing the step seed")
        words, tensors = encode(value)
        messages: list[tuple[int, torch.Tensor]] = []
        frame_tag = FRAMES
        if self.known.changed(key, words):
            # The receiver posted a buffer for the old layout (or a header): announce the new
            # one in it; the frame follows on the other tag, which the receiver posts on reading.
            before = self.known.sent.get(key)
            self.known.sent[key] = Frame.of(words)
            head, extra = header(words, self.seed, key)
            posted = before.nbytes if before is not None else HEADER_BYTES
            messages.append((FRAMES, filling(head, posted).to(self.comm_device)))
            if extra is not None:
                messages.append((FOLLOW_UPS, extra.to(self.comm_device)))
            frame_tag = FOLLOW_UPS
        frame = self.known.sent[key]
        messages.append((frame_tag, pack(frame, tensors, self.seed, key, self.comm_device)))
        works = [dist.isend(m, dst=dst, group=self.group, tag=tag) for tag, m in messages]
        # The bytes stay alive until sent; those already through are let go (a recomputed
        # micro-batch's output would otherwise live until the end of the step).
        self._sends = [s for s in self._sends if not all(w.is_completed() for w in s[1])]
        self._sends.append((key, works, [m for _, m in messages]))
        self.pump()

    # ---- receiving -------------------------------------------------------------------------

    def start(self, actions: Sequence[Sequence[Action]]) -> None:
        """Posts this step's receives, given every worker's actions (``Schedule.actions``)."""
        for peer, order in receive_plan(tuple(map(tuple, actions)), self.layout):
            stream = _Stream(peer, list(order))
            self._streams[peer] = stream
            for key in order:
                self._source[key] = peer
            self._refill(stream, POSTED_AT_START)

    def get(self, key: Key) -> Any:
        peer = self._source.pop(key, None)
        if peer is None:
            return super().get(key)  # a local key (stage 0's inputs, a stage on this rank)
        stream = self._streams[peer]
        while key not in self._arrived:
            self._post_while_waiting(stream)
            self._take(stream)
        arrived = self._arrived.pop(key)
        if arrived.follow_up is not None:  # the frame of a layout announced this step
            self._check_frame(arrived.follow_up, peer)
        return arrived.value

    def pump(self) -> None:
        """Takes every message already in (never blocks), so that announcements' frames are
        posted early."""
        for stream in self._streams.values():
            while stream.posted and stream.posted[0].work.is_completed():
                self._take(stream)

    def _limit(self, stream: _Stream) -> int:
        return len(stream.order) if self.ahead is None else self.ahead

    def _refill(self, stream: _Stream, upto: int) -> None:
        """Posts the peer's next receives until ``upto`` (at most the limit) are pending."""
        upto = min(upto, self._limit(stream))
        while len(stream.posted) < upto and stream.next < len(stream.order):
            self._post_next(stream)

    def _post_while_waiting(self, stream: _Stream) -> None:
        """Posts the peer's further receives while its next message is not in: time the rank
        would spend waiting anyway. One at a time, so that an arrival ends it at once."""
        limit = self._limit(stream)
        while (
            stream.posted
            and len(stream.posted) < limit
            and stream.next < len(stream.order)
            and not stream.posted[0].work.is_completed()
        ):
            self._post_next(stream)

    def _post_next(self, stream: _Stream) -> None:
        key = stream.order[stream.next]
        stream.next += 1
        frame = self.known.received.get(key)
        stream.posted.append(self._post(stream.peer, key, frame, FRAMES))

    def _post(self, peer: int, key: Key, frame: Frame | None, tag: int) -> _Posted:
        size = frame.nbytes if frame is not None else HEADER_BYTES
        buffer = torch.empty(size, dtype=torch.uint8, device=self.comm_device)
        work = dist.irecv(buffer, src=peer, group=self.group, tag=tag)
        return _Posted(key, buffer, work, frame)

    def _take(self, stream: _Stream) -> None:
        """Completes the peer's next message: a frame's value, or a layout announced (whose
        frame's receive it posts)."""
        if not stream.posted:
            raise RankFailure(f"{self.layout.label()} expected no more messages from {stream.peer}")
        posted = stream.posted.popleft()
        wait_receive(posted.work, posted.key, self.layout, self.wait_timeout, self.board)
        n, seed, key = self._check_prefix(posted, stream.peer)
        if n == 0:
            assert posted.frame is not None  # checked with the prefix
            self._arrived[key] = _Arrived(unpack(posted.frame, posted.buffer))
        else:
            frame = self._announced(posted, stream.peer, n)
            follow_up = self._post(stream.peer, key, frame, FOLLOW_UPS)
            self._arrived[key] = _Arrived(unpack(frame, follow_up.buffer), follow_up)
        self._refill(stream, POSTED_AT_START)

    def _announced(self, posted: _Posted, peer: int, n: int) -> Frame:
        """The layout an announcement describes (its extra words received), now known."""
        head = posted.buffer[:HEADER_BYTES].view(torch.int64).cpu()
        extra = None
        if extra_words(head):
            extra = torch.empty(extra_words(head), dtype=torch.int64, device=self.comm_device)
            work = dist.irecv(extra, src=peer, group=self.group, tag=FOLLOW_UPS)
            wait_receive(work, posted.key, self.layout, self.wait_timeout, self.board)
            extra = extra.cpu()
        frame = Frame.of(words_of(head, extra))
        self.known.received[posted.key] = frame
        return frame

    def _check_frame(self, posted: _Posted, peer: int) -> None:
        wait_receive(posted.work, posted.key, self.layout, self.wait_timeout, self.board)
        self._check_prefix(posted, peer)

    def _check_prefix(self, posted: _Posted, peer: int) -> tuple[int, int, Key]:
        """The message's (n, seed, key), checked against what was posted for it."""
        n, seed, key, size = prefix_of(posted.buffer)
        if key != posted.key or (n == 0 and (posted.frame is None or size != posted.frame.nbytes)):
            raise RankFailure(
                explain(
                    self.board,
                    f"{self.layout.label()} got an unexpected message {key} from rank {peer} "
                    f"(expected {describe(posted.key)})",
                )
            )
        self._check_seed(seed, key)
        return n, seed, key

    def _check_seed(self, seed: int, key: Key) -> None:
        if self.seed is None:
            self.seed = seed
            if self.on_seed is not None:
                self.on_seed(seed)
        elif seed != self.seed:
            raise RankFailure(
                explain(
                    self.board,
                    f"{self.layout.label()} received {describe(key)} of another step "
                    f"(seed {seed}, expected {self.seed}); are all ranks running the same step?",
                )
            )

    # ---- the end of a step ---------------------------------------------------------------

    def finish(self) -> None:
        """Waits until this step's sends are through."""
        for key, works, _ in self._sends:
            what = f"sending {describe(key)} to {self.layout.label(key[1])}"
            for work in works:
                wait_work(work, self.wait_timeout, what, self.board)
        self.drop()

    def check(self) -> None:
        """Nothing is left to check after :meth:`finish`: every request of the step was waited
        on the host, raising its failure (the device transport's is
        :meth:`giantpipe.engine.distributed.ordered.OrderedMailbox.check`)."""

    def drop(self) -> None:
        """Forgets every request in flight (so a failed step's groups can be torn down)."""
        self._sends.clear()
        self._streams.clear()
        self._arrived.clear()
        self.group = None
