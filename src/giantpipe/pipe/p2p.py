"""The executor's mailbox, stretched across processes with point-to-point messages.

The local executor hands values between stages through a :class:`Mailbox` keyed
``("act", stage, m)`` / ``("grad", stage, m)``. :class:`P2PMailbox` keeps that interface, so the
very same ``StepRun`` drives one rank of a distributed pipeline:

- ``put`` of a key whose consumer stage lives on another rank is an asynchronous send
  (``isend``): the rank computes on while the bytes travel;
- at the start of the step, this rank posts a receive for the header of every key it will get
  from another rank (it knows them from its list of actions). As soon as a header is in, the
  receives for exactly the announced bytes are posted (:mod:`giantpipe.pipe.wire`); ``get`` then
  waits for the rest. Headers are checked between actions ("pumped"), so the bytes of the next
  activation flow while the current micro-batch computes::

      rank 0 | F0 isend(act1,0)  F1 isend(act1,1)  F2 ...
      rank 1 |    hdr0 -> irecv bytes0 | get(act1,0) F0 (hdr1 in: irecv bytes1) | get(act1,1) F1

  Everything runs on the rank's main thread (gloo's own I/O thread moves the bytes): no Python
  thread hand-offs, which on a loaded machine cost milliseconds each.

Messages of one key share a tag, ((m * stages + stage) * 2 + kind); gloo matches the messages
of a (peer, tag) pair in order, so a header and its bytes cannot be mixed up with another key's.

A receive that fails names its peer: a closed connection ("rank 1 (stage 1) is gone"), or a wait
longer than ``timeout`` ("rank 0 (stage 0) timed out after 60s waiting for the gradient of
micro-batch 3 from rank 1 (stage 1)"); it is reported on the failure board and raised as
:class:`~giantpipe.pipe.faults.RankFailure`.

Example (on each rank, inside a process group)::

    box = P2PMailbox(layout, groups.p2p, timeout=60.0, board=board, seed=seed_or_None)
    box.start(my_actions)
    run = StepRun(config, micro_batches if layout.needs_inputs else [], mailbox=box)
    run.run(my_schedule)
    box.finish()   # this step's sends are through
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.pipe.faults import FailureBoard, RankFailure, explain, wait_work
from giantpipe.pipe.layout import Layout
from giantpipe.pipe.mailbox import Key, Mailbox
from giantpipe.pipe.schedule import Action
from giantpipe.pipe.wire import (
    HEADER_WORDS,
    allocate,
    as_bytes,
    decode,
    encode,
    extra_words,
    header,
    seed_of,
    words_of,
)


def tag_of(key: Key, num_stages: int) -> int:
    """The p2p tag of a key: distinct per (kind, stage, micro-batch) within a step."""
    kind, stage, m = key
    return (m * num_stages + stage) * 2 + (0 if kind == "act" else 1)


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
class _Incoming:
    """One key on its way in: the header receive, then the receives of its bytes."""

    peer: int
    head: torch.Tensor
    head_work: Any
    value: Any = None
    works: list[Any] = field(default_factory=list)
    posted: bool = False


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
        self._incoming: dict[Key, _Incoming] = {}
        self._queues: list[deque[Key]] = []  # per peer, keys whose bytes are not yet posted
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
        head, extra = header(words, self.seed)
        messages = [head] + ([extra] if extra is not None else [])
        messages += [as_bytes(t.to(self.comm_device)) for t in tensors if t.numel()]
        tag = tag_of(key, self.layout.num_stages)
        works = [dist.isend(msg, dst=dst, group=self.group, tag=tag) for msg in messages]
        self._sends.append((key, works, messages))  # the bytes stay alive until sent
        self.pump()

    # ---- receiving -------------------------------------------------------------------------

    def start(self, actions: Sequence[Action]) -> None:
        """Posts the header receive of every key this rank will get from another rank."""
        for peer, keys in expected_receives(actions, self.layout).items():
            for key in keys:
                head = torch.empty(HEADER_WORDS, dtype=torch.int64)
                tag = tag_of(key, self.layout.num_stages)
                work = dist.irecv(head, src=peer, group=self.group, tag=tag)
                self._incoming[key] = _Incoming(peer, head, work)
            self._queues.append(deque(keys))

    def get(self, key: Key) -> Any:
        incoming = self._incoming.pop(key, None)
        if incoming is None:
            return super().get(key)  # a local key (stage 0's inputs, a stage on this rank)
        if not incoming.posted:
            self._post(key, incoming)
        for work in incoming.works:
            self._wait(work, incoming.peer, key)
        self.pump()
        return incoming.value

    def pump(self) -> None:
        """Posts the byte receives of every key whose header is in (never blocks)."""
        for queue in self._queues:
            while queue:
                incoming = self._incoming.get(queue[0])
                if incoming is None or incoming.posted:
                    queue.popleft()
                elif incoming.head_work.is_completed():
                    self._post(queue.popleft(), incoming)
                else:
                    break

    def _post(self, key: Key, incoming: _Incoming) -> None:
        peer, tag = incoming.peer, tag_of(key, self.layout.num_stages)
        self._wait(incoming.head_work, peer, key)
        self._check_seed(seed_of(incoming.head), key)
        extra = None
        if extra_words(incoming.head):
            extra = torch.empty(extra_words(incoming.head), dtype=torch.int64)
            self._wait(dist.irecv(extra, src=peer, group=self.group, tag=tag), peer, key)
        value, buffers = allocate(decode(words_of(incoming.head, extra)), self.comm_device)
        incoming.works = [dist.irecv(b, src=peer, group=self.group, tag=tag) for b in buffers]
        incoming.value, incoming.posted = value, True

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
        self._incoming.clear()
        self._queues.clear()
        self.group = None
