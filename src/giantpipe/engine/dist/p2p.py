"""The executor's mailbox, stretched across processes with point-to-point messages.

The local executor hands values between stages through a :class:`Mailbox` keyed
``("act", stage, m)`` / ``("grad", stage, m)``. :class:`P2PMailbox` keeps that interface, so the
very same ``StepRun`` drives one rank of a distributed pipeline:

- ``put`` of a key whose consumer stage lives on another rank is an asynchronous send
  (``isend``): the rank computes on while the bytes travel;
- from each peer, messages are taken in the order the peer sent them: a header (which names
  the key and describes the value, :mod:`giantpipe.engine.dist.wire`), then exactly the announced
  bytes. A value that arrives before it is needed waits in the mailbox; ``get`` of a value not
  yet in takes the peer's messages until it is. Headers are checked between actions ("pumped")
  and their bytes' receives posted at once, so the next activation flows while the current
  micro-batch computes::

      rank 0 | F0 isend(act1,0)  F1 isend(act1,1)  F2 ...
      rank 1 |    hdr0 -> irecv bytes0 | get(act1,0) F0 (hdr1 in: irecv bytes1) | get(act1,1) F1

  Everything runs on the rank's main thread (gloo's own I/O thread moves the bytes): no Python
  thread hand-offs, which on a loaded machine cost milliseconds each. Taking messages in the
  sender's order needs no tags (NCCL has none) and cannot deadlock: a rank only ever waits for
  messages its peer has already committed to sending before the one it needs.

A receive that fails names its peer: a closed connection ("rank 1 (stage 1) is gone"), or a wait
longer than ``timeout`` ("rank 0 (stage 0) timed out after 60s waiting for the gradient of
micro-batch 3 from rank 1 (stage 1)"); it is reported on the failure board and raised as
:class:`~giantpipe.engine.dist.faults.RankFailure`.

Example (on each rank, inside a process group)::

    box = P2PMailbox(layout, groups.p2p, timeout=60.0, board=board, seed=seed_or_None)
    box.start(my_actions)
    run = StepRun(config, micro_batches if layout.needs_inputs else [], mailbox=box)
    run.run(my_schedule)
    box.finish()   # this step's sends are through
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.engine.dist.faults import FailureBoard, RankFailure, explain, wait_work
from giantpipe.engine.dist.layout import Layout
from giantpipe.engine.workers import Key, Mailbox
from giantpipe.engine.schedule import Action
from giantpipe.engine.dist.wire import (
    HEADER_WORDS,
    allocate,
    as_bytes,
    decode,
    encode,
    extra_words,
    header,
    key_of,
    seed_of,
    words_of,
)


def describe(key: Key) -> str:
    kind, _, m = key
    return f"the {'activation' if kind == 'act' else 'gradient'} of micro-batch {m}"


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


@dataclass
class _Stream:
    """Messages from one peer in this step: the keys still to come, the pending header."""

    peer: int
    waiting_for: list[Key]  # in the order this rank needs them (the peer's may differ)
    head: torch.Tensor | None = None
    head_work: Any = None


@dataclass
class _Arrived:
    """A value whose header is in; its bytes are on their way (or in)."""

    peer: int
    value: Any
    works: list[Any] = field(default_factory=list)


class P2PMailbox(Mailbox):
    """A mailbox whose producers and consumers may be other ranks (one step's worth).

    ``seed`` is the step's seed where this rank draws it (it holds stage 0); elsewhere it is
    None until the first message brings it, and ``on_seed`` is told (before the action that
    needs it runs).
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
    ) -> None:
        super().__init__(timeout)
        self.layout, self.group, self.wait_timeout, self.board = layout, group, timeout, board
        self.comm_device = comm_device or torch.device("cpu")
        self.seed, self.on_seed = seed, on_seed
        self._streams: dict[int, _Stream] = {}
        self._source: dict[Key, int] = {}  # remote keys still to be got -> the peer sending it
        self._arrived: dict[Key, _Arrived] = {}
        self._sends: list[tuple[Key, list[Any], list[torch.Tensor]]] = []

    # ---- sending ---------------------------------------------------------------------------

    def put(self, key: Key, value: Any) -> None:
        dst = self.layout.rank_of_stage(key[1])
        if dst == self.layout.rank:
            super().put(key, value)
            return
        if self.seed is None:
            raise RuntimeError(f"{self.layout.label()} sends before knowing the step seed")
        words, tensors = encode(value)
        head, extra = header(words, self.seed, key)
        messages = [head] + ([extra] if extra is not None else [])
        messages = [m.to(self.comm_device) for m in messages]
        messages += [as_bytes(t.to(self.comm_device)) for t in tensors if t.numel()]
        works = [dist.isend(msg, dst=dst, group=self.group) for msg in messages]
        # The bytes stay alive until sent; those already through are let go (a recomputed
        # micro-batch's output would otherwise live until the end of the step).
        self._sends = [s for s in self._sends if not all(w.is_completed() for w in s[1])]
        self._sends.append((key, works, messages))
        self.pump()

    # ---- receiving -------------------------------------------------------------------------

    def start(self, actions: Sequence[Action]) -> None:
        """Posts the first header receive from every peer that will send to this rank."""
        for peer, keys in expected_receives(actions, self.layout).items():
            stream = _Stream(peer, list(keys))
            self._next_header(stream)
            self._streams[peer] = stream
            for key in keys:
                self._source[key] = peer

    def get(self, key: Key) -> Any:
        peer = self._source.pop(key, None)
        if peer is None:
            return super().get(key)  # a local key (stage 0's inputs, a stage on this rank)
        stream = self._streams[peer]
        while key not in self._arrived:
            self._take_header(stream, waiting_for=key)
        arrived = self._arrived.pop(key)
        for work in arrived.works:
            self._wait(work, peer, key)
        self.pump()
        return arrived.value

    def pump(self) -> None:
        """Takes every header already in and posts its bytes' receives (never blocks)."""
        for stream in self._streams.values():
            while stream.head_work is not None and stream.head_work.is_completed():
                self._take_header(stream, waiting_for=stream.waiting_for[0])

    def _next_header(self, stream: _Stream) -> None:
        if not stream.waiting_for:
            stream.head = stream.head_work = None  # nothing more from this peer this step
            return
        stream.head = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.comm_device)
        stream.head_work = dist.irecv(stream.head, src=stream.peer, group=self.group)

    def _take_header(self, stream: _Stream, waiting_for: Key) -> None:
        """Completes the peer's next header and posts the receives of the bytes it announces."""
        if stream.head is None:
            raise RankFailure(f"{self.layout.label()} expected no more messages for {waiting_for}")
        self._wait(stream.head_work, stream.peer, waiting_for)
        head = stream.head.cpu()
        key = key_of(head)
        if key not in stream.waiting_for:
            raise RankFailure(
                explain(self.board, f"{self.layout.label()} got an unexpected message {key}")
            )
        stream.waiting_for.remove(key)
        self._check_seed(seed_of(head), key)
        extra = None
        if extra_words(head):
            extra = torch.empty(extra_words(head), dtype=torch.int64, device=self.comm_device)
            self._wait(dist.irecv(extra, src=stream.peer, group=self.group), stream.peer, key)
            extra = extra.cpu()
        value, buffers = allocate(decode(words_of(head, extra)), self.comm_device)
        works = [dist.irecv(b, src=stream.peer, group=self.group) for b in buffers]
        self._arrived[key] = _Arrived(stream.peer, value, works)
        self._next_header(stream)

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

    def _wait(self, work: Any, peer: int, key: Key) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.wait_timeout))
        except Exception as exc:  # noqa: BLE001 - becomes a message naming the peer
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            stage = key[1] - 1 if key[0] == "act" else key[1] + 1
            me, them = self.layout.label(), self.layout.label(stage)
            if "Timed out" in text:
                local = (
                    f"{me} timed out after {self.wait_timeout:.0f}s waiting for "
                    f"{describe(key)} from {them}"
                )
            elif "closed" in text.lower() or "reset" in text.lower():
                local = f"{them} is gone (connection closed); {me} waited for {describe(key)}"
            else:
                local = f"{me} failed to receive {describe(key)} from {them}: {text}"
            raise RankFailure(explain(self.board, local)) from exc

    # ---- the end of a step ---------------------------------------------------------------

    def finish(self) -> None:
        """Waits until this step's sends are through."""
        for key, works, _ in self._sends:
            what = f"sending {describe(key)} to {self.layout.label(key[1])}"
            for work in works:
                wait_work(work, self.wait_timeout, what, self.board)
        self.drop()

    def drop(self) -> None:
        """Forgets every request in flight (so a failed step's groups can be torn down)."""
        self._sends.clear()
        self._streams.clear()
        self._arrived.clear()
        self.group = None
