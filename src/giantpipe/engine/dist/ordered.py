"""The device transport: descriptions on the host, bytes on the device, in one agreed order.

:class:`~giantpipe.engine.dist.p2p.P2PMailbox` suits gloo: messages match by peer and tag, a
receive may be posted far ahead, and a frame carries its own header. NCCL differs in three
ways, and :class:`OrderedMailbox` is the same mailbox built for them:

1. **One order per pair.** NCCL runs a pair's sends and receives on one stream in issue order,
   each blocking until its match runs on the peer. Every device operation is issued in the
   order of :func:`worker_ops`, which every rank derives from the schedule, so both ends of
   every pair agree (see "The order" below).
2. **No host round trip.** Reading a header that arrived on the GPU waits for the GPU
   (``.cpu()``), and writing one from the host is a blocking copy: the host could never run
   ahead. Here the description of a value (its layout, key and the step's seed) travels as a
   small host message on the control group (gloo), through a :class:`P2PMailbox` of its own
   (receives posted ahead, layouts known from the step before), and the payload is the bare
   bytes of the tensors, packed and unpacked on the device by kernels only::

       put(key):  control.put(key, layout words)   -> gloo, now
                  receives ordered before key       -> posted (their layouts from control)
                  isend(payload)                    -> NCCL, in order
       get(key):  receives ordered up to key        -> posted
                  wait(payload)                     -> the consumer's stream waits, not the host

3. **Failures on the host.** A dead or silent peer is named by the control plane's waits, which
   time out and wake on closed connections (gloo); a device operation's ``wait`` only makes the
   stream wait, so the end of the step waits for the device with a deadline
   (:func:`giantpipe.engine.dist.faults.wait_device`).

The same code runs on CPU with gloo for both groups (``DistributedPipe(transport="ordered")``):
the tests record its device operations and replay them under NCCL's rule.

Example (on each rank; ``known`` lives as long as the pipe)::

    box = OrderedMailbox(layout, groups.control, groups.p2p, timeout=60.0, board=board,
                         device=torch.device("cuda", local_rank), seed=seed, known=known)
    box.start(schedule.actions)
    run = StepRun(config, micro_batches if layout.needs_inputs else [], mailbox=box)
    run.run(my_schedule)
    box.finish()

**The order.** NCCL runs every point-to-point operation between two ranks on one stream, in the
order each rank issued them, and a send or a receive completes only while its match runs on the
peer (NCCL documents ``ncclSend``/``ncclRecv`` as blocking for the GPU). Two ranks that issue their
operations for one pair in different orders wait for each other for ever::

    rank 0 | irecv(grad 1,0)    isend(act 1,0)      <- the receive holds the stream
    rank 1 | irecv(act 1,0)     ...                 <- waits for a send queued behind it

Gloo matches messages by peer and tag, so no such rule shows on CPU. Here the rule is kept by
construction: the step's schedule (which every rank has) is simulated once, with unit costs
(F = 1, B = 2, or B = 1 and W = 1 where the schedule splits the backward), and every message
between two ranks gets its place in one global order: the simulated time its producer ends,
ties broken by stage and micro-batch. Each rank then issues its device operations in that order
(:class:`OrderedMailbox`): before a send, the receives placed before it; before
waiting for a receive, the receives placed before it. Every rank's operations on every pair
are thus issued in one order at both ends, and across pairs in one global order, so even a
rank that ran one operation at a time could not deadlock.

This order is possible for every valid schedule: a rank's own sends are in its program order
(its actions run in sequence), and a message it needs before an action was produced, in the
simulation, before that action started; so whatever the order asks a rank to issue first is a
send it has already made or a receive it can post ahead.

Example::

    >>> from giantpipe.engine.schedules import build_schedule
    >>> s = build_schedule("1f1b", 2, 3)
    >>> [f"{m.key[0]}{m.key[2]}:{m.src}->{m.dst}" for m in message_order(s.actions, s.placement)]
    ['act0:0->1', 'act1:0->1', 'grad0:1->0', 'act2:0->1', 'grad1:1->0', 'grad2:1->0']
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from giantpipe.engine.dist.faults import FailureBoard, wait_work
from giantpipe.engine.dist.layout import Layout
from giantpipe.engine.dist.p2p import P2PMailbox, describe, wait_receive
from giantpipe.engine.dist.wire import Frame, KnownLayouts, encode, pack, unpack
from giantpipe.engine.schedule import Action, dependencies
from giantpipe.engine.workers import Key, Mailbox

PAYLOADS = 2  # tag of payloads (the control mailbox uses 0 and 1; on CPU the groups may be one)


class Message(NamedTuple):
    """A boundary value that crosses from worker ``src`` to worker ``dst``."""

    key: Key  # the consumer's mailbox key: ("act", stage, m) or ("grad", stage, m)
    src: int
    dst: int


class Op(NamedTuple):
    """One device operation of a rank: send ``key`` to ``peer``, or receive it from ``peer``."""

    kind: str  # "send" | "recv"
    key: Key
    peer: int  # a worker of this rank's pipeline


def _costs(actions: Sequence[Sequence[Action]]) -> dict[Action, int]:
    split = {(a.stage, a.microbatch) for worker in actions for a in worker if a.kind == "W"}
    cost = {}
    for worker in actions:
        for a in worker:
            whole_b = a.kind == "B" and (a.stage, a.microbatch) not in split
            cost[a] = 2 if whole_b else 1
    return cost


def simulate_ends(actions: Sequence[Sequence[Action]], num_stages: int) -> dict[Action, int]:
    """When each action ends if every worker runs its list in order, each action starting as
    soon as its worker is free and its inputs are done (unit costs, see the module docstring).

    >>> from giantpipe.engine.schedules import build_schedule
    >>> ends = simulate_ends(build_schedule("gpipe", 2, 2).actions, 2)
    >>> [ends[a] for a in build_schedule("gpipe", 2, 2).actions[1]]
    [2, 3, 5, 7]
    """
    cost = _costs(actions)
    ends: dict[Action, int] = {}
    cursors, free = [0] * len(actions), [0] * len(actions)
    remaining = sum(map(len, actions))
    while remaining:
        progressed = False
        for w, worker in enumerate(actions):
            while cursors[w] < len(worker):
                action = worker[cursors[w]]
                deps = dependencies(action, num_stages)
                if any(d not in ends for d in deps):
                    break
                start = max([free[w], *(ends[d] for d in deps)])
                ends[action] = free[w] = start + cost[action]
                cursors[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks; validate() it first")
    return ends


@functools.lru_cache(maxsize=64)
def message_order(
    actions: tuple[tuple[Action, ...], ...], placement: tuple[int, ...]
) -> tuple[Message, ...]:
    """Every message between two workers in one step of ``actions``, in the global order.

    Values between stages of one worker (interleaved schedules, ZB-V) stay in its mailbox and
    are not messages. Cached: a pipe runs the same schedule step after step.
    """
    ends = simulate_ends(actions, len(placement))
    last = len(placement) - 1
    timed: list[tuple[int, int, int, Message]] = []
    for action, end in ends.items():
        kind, stage, m = action
        if kind == "F" and stage < last:
            key, consumer = ("act", stage + 1, m), stage + 1
        elif kind == "B" and stage > 0:
            key, consumer = ("grad", stage - 1, m), stage - 1
        else:
            continue
        src, dst = placement[stage], placement[consumer]
        if src != dst:
            timed.append((end, stage, m, Message(key, src, dst)))
    # Ties: two producers ending at once are on two workers; any fixed rule does.
    timed.sort(key=lambda t: (t[0], t[1], t[2], t[3].key[0]))
    return tuple(message for *_, message in timed)


@functools.lru_cache(maxsize=64)
def worker_ops(
    actions: tuple[tuple[Action, ...], ...], placement: tuple[int, ...], worker: int
) -> tuple[Op, ...]:
    """The device operations of ``worker`` in the order it must issue them.

    >>> from giantpipe.engine.schedules import build_schedule
    >>> s = build_schedule("1f1b", 2, 2)
    >>> [f"{op.kind} {op.key[0]}{op.key[2]}" for op in worker_ops(s.actions, s.placement, 1)]
    ['recv act0', 'recv act1', 'send grad0', 'send grad1']
    """
    ops = []
    for message in message_order(actions, placement):
        if message.src == worker:
            ops.append(Op("send", message.key, message.dst))
        elif message.dst == worker:
            ops.append(Op("recv", message.key, message.src))
    return tuple(ops)


class OrderedMailbox(Mailbox):
    """A mailbox across ranks whose device operations follow the step's agreed order.

    ``control`` is a host (gloo) group and ``payload`` the device group of every rank (they
    may be the same gloo group on CPU). ``seed``/``on_seed``/``known`` are as
    :class:`P2PMailbox`'s (the control mailbox carries the seed and keeps the layouts).
    """

    def __init__(
        self,
        layout: Layout,
        control: Any,
        payload: Any,
        timeout: float,
        board: FailureBoard | None = None,
        device: torch.device | None = None,
        seed: int | None = None,
        on_seed: Callable[[int], None] | None = None,
        known: KnownLayouts | None = None,
    ) -> None:
        super().__init__(timeout)
        self.layout, self.payload_group, self.wait_timeout = layout, payload, timeout
        self.board = board
        self.device = device or torch.device("cpu")
        # Descriptions: a value of layout words per key, as P2PMailbox sends any value.
        self.control = P2PMailbox(
            layout, control, timeout, board, seed=seed, on_seed=on_seed, known=known
        )
        self._ops: tuple[Op, ...] = ()
        self._index: dict[tuple[str, Key], int] = {}
        self._issued = 0  # self._ops[: self._issued] are issued
        self._posted: dict[Key, tuple[Frame, torch.Tensor | None, Any]] = {}
        self._sends: list[tuple[Key, Any, torch.Tensor]] = []

    @property
    def seed(self) -> int | None:
        return self.control.seed

    # ---- the order -------------------------------------------------------------------------

    def start(self, actions: Sequence[Sequence[Action]]) -> None:
        """Learns this step's order from every worker's actions and posts the control
        receives."""
        plan = tuple(map(tuple, actions))
        self._ops = worker_ops(plan, self.layout.placement, self.layout.worker)
        self._index = {(op.kind, op.key): i for i, op in enumerate(self._ops)}
        self._issued = 0
        self.control.start(actions)

    def _issue_until(self, end: int) -> None:
        """Issues the receives of ``self._ops[:end]`` not issued yet. Every send before them
        was issued by its ``put`` already: this rank's actions produce them in that order."""
        while self._issued < end:
            op = self._ops[self._issued]
            if op.kind == "send":
                raise RuntimeError(
                    f"{self.layout.label()} must send {describe(op.key)} before going on, but "
                    "has not computed it: the step's actions do not follow the agreed order"
                )
            self._post(op)
            self._issued += 1

    def _peer(self, worker: int) -> int:
        return self.layout.replica * self.layout.workers + worker

    # ---- sending ---------------------------------------------------------------------------

    def consumed_here(self, key: Key) -> bool:
        return self.layout.rank_of_stage(key[1]) == self.layout.rank

    def put(self, key: Key, value: Any) -> None:
        position = self._index.get(("send", key))
        if position is None:  # a stage of this rank (or stage 0's inputs)
            super().put(key, value)
            return
        words, tensors = encode(value)
        # The description first: the peer may be waiting for it to post earlier receives.
        self.control.put(key, torch.tensor(words, dtype=torch.int64))
        self._issue_until(position)
        frame = Frame.of(words, head=0)
        if frame.nbytes:
            seed = self.control.seed or 0
            message = pack(frame, tensors, seed, key, self.device)
            dst = self._peer(self._ops[position].peer)
            work = dist.isend(message, dst=dst, group=self.payload_group, tag=PAYLOADS)
            self._sends = [s for s in self._sends if not s[1].is_completed()]
            self._sends.append((key, work, message))
        self._issued = position + 1

    # ---- receiving -------------------------------------------------------------------------

    def _post(self, op: Op) -> None:
        """Posts the payload receive of ``op`` (its layout from the control mailbox)."""
        words = self.control.get(op.key).tolist()
        frame = Frame.of(words, head=0)
        buffer = work = None
        if frame.nbytes:
            buffer = torch.empty(frame.nbytes, dtype=torch.uint8, device=self.device)
            src = self._peer(op.peer)
            work = dist.irecv(buffer, src=src, group=self.payload_group, tag=PAYLOADS)
        self._posted[op.key] = (frame, buffer, work)

    def get(self, key: Key) -> Any:
        position = self._index.get(("recv", key))
        if position is None:
            return super().get(key)
        self._issue_until(position + 1)
        frame, buffer, work = self._posted.pop(key)
        if buffer is None:
            return unpack(frame, torch.empty(0, dtype=torch.uint8, device=self.device))
        self._wait(work, key)
        return unpack(frame, buffer)

    def _wait(self, work: Any, key: Key) -> None:
        """On the device, the consumer's stream waits for the payload (the host goes on); on
        the host (gloo standing in), the rank waits, under the timeout, naming the peer."""
        if self.device.type == "cuda":
            work.wait()
            return
        wait_receive(work, key, self.layout, self.wait_timeout, self.board)

    # ---- the end of a step -----------------------------------------------------------------

    def finish(self) -> None:
        """Waits until this step's sends are through: the control plane's on the host; the
        payloads' on the host where gloo carries them (NCCL holds its buffers itself, and the
        step's end waits for the device)."""
        self.control.finish()
        if self.device.type != "cuda":
            for key, work, _ in self._sends:
                what = f"sending the payload of {describe(key)} to {self.layout.label(key[1])}"
                wait_work(work, self.wait_timeout, what, self.board)
        self._sends.clear()
        self._posted.clear()

    def drop(self) -> None:
        """Forgets every request in flight (so a failed step's groups can be torn down)."""
        self.control.drop()
        self._sends.clear()
        self._posted.clear()
        self.payload_group = None
