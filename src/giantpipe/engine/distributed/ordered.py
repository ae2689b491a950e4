"""The device transport: descriptions on the host, bytes on the device, in one agreed order.

:class:`~giantpipe.engine.distributed.p2p.P2PMailbox` suits gloo: messages match by peer and tag, a
receive may be posted far ahead, and a frame carries its own header. NCCL differs in three
ways, and :class:`OrderedMailbox` is the same mailbox built for them:

1. **One order per pair.** NCCL runs a pair's sends and receives on one stream in issue order,
   each blocking until its match runs on the peer. Every device operation is issued in the
   order of :func:`~giantpipe.engine.distributed.message_order.worker_ops`, which every rank derives
   from the schedule, so both ends of every pair agree (:mod:`.message_order`).
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
   (:func:`giantpipe.engine.distributed.faults.wait_device`), and then :meth:`OrderedMailbox.check`
   asks every payload request of the step whether it succeeded: NCCL's watchdog may have
   aborted one (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) before the device wait ended, leaving a
   buffer partly received, and no value of such a step may leave it. A request found complete
   earlier is checked (and let go) at once, so a step holds only requests still in flight.

The same code runs on CPU with gloo for both groups (``DistributedPipe(transport="ordered")``):
the tests record its device operations and replay them under NCCL's rule. Which transport a
pipe uses is :func:`choose_transport`'s: this one on CUDA, frames on CPU.

One concept, one class: :class:`OrderedMailbox` (its section dividers group its methods).

Example (on each rank; ``known`` lives as long as the pipe)::

    box = OrderedMailbox(layout, groups.control, groups.p2p, timeout=60.0, board=board,
                         device=torch.device("cuda", local_rank), seed=seed, known=known)
    box.start(schedule.actions)
    run = StepRun(config, micro_batches if layout.needs_inputs else [], mailbox=box)
    run.run(my_schedule)
    box.finish()
    box.check()          # after the step's device wait: every payload request succeeded
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.engine.distributed.faults import FailureBoard, wait_work
from giantpipe.engine.distributed.layout import Layout
from giantpipe.engine.distributed.message_order import Op, worker_ops
from giantpipe.engine.distributed.p2p import P2PMailbox, describe, wait_receive
from giantpipe.engine.distributed.wire import Frame, KnownLayouts, encode, pack, unpack
from giantpipe.engine.mailbox import Key, Mailbox
from giantpipe.engine.schedules.actions import Action

PAYLOADS = 2  # tag of payloads (the control mailbox uses 0 and 1; on CPU the groups may be one)


TRANSPORTS = ("auto", "frames", "ordered")


def choose_transport(transport: str, device: torch.device) -> str:
    """The transport a pipe on ``device`` uses (see ``DistributedPipe``'s ``transport``).

    >>> [choose_transport("auto", torch.device(d)) for d in ("cpu", "cuda:0")]
    ['frames', 'ordered']
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    if transport == "frames" and device.type == "cuda":
        # Frames carry headers read by the host and receives posted out of NCCL's order.
        raise ValueError("transport='frames' needs gloo and host memory; on CUDA use 'ordered'")
    if transport == "auto":
        return "ordered" if device.type == "cuda" else "frames"
    return transport


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
        # Payload requests not yet checked: (request, what it moves to or from whom, the bytes
        # a send must keep alive until it is through).
        self._pending: list[tuple[Any, str, torch.Tensor | None]] = []

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
            self._settle()
            to = self.layout.label(key[1])
            self._pending.append((work, f"sending the payload of {describe(key)} to {to}", message))
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
        self._settle()
        if self._on_device():  # the stream waits; the request is checked later (check)
            work.wait()
            producer = self.layout.label(key[1] - 1 if key[0] == "act" else key[1] + 1)
            self._pending.append((work, f"receiving {describe(key)} from {producer}", None))
        else:  # gloo standing in: the host waits, under the timeout, naming the peer
            wait_receive(work, key, self.layout, self.wait_timeout, self.board)
        return unpack(frame, buffer)

    def _on_device(self) -> bool:
        """Whether payloads are device operations (NCCL), which a wait without a timeout only
        orders on the stream, rather than the host's (gloo: a request is waited on once)."""
        return self.device.type == "cuda"

    # ---- the end of a step -----------------------------------------------------------------

    def finish(self) -> None:
        """Waits until this step's sends are through: the control plane's on the host; the
        payloads' on the host where gloo carries them (on CUDA the step's end waits for the
        device, then :meth:`check`)."""
        self.control.finish()
        if not self._on_device():
            self.check()
        self._posted.clear()

    def check(self) -> None:
        """Raises :class:`~giantpipe.engine.distributed.faults.RankFailure` naming the peer unless
        every payload request of the step not yet waited on the host succeeded (on CUDA: call
        it after the step's device wait, when each has run; each is waited on the host under
        the timeout, once: a gloo request cannot be waited on twice)."""
        pending, self._pending = self._pending, []
        for work, what, _ in pending:
            wait_work(work, self.wait_timeout, what, self.board)

    def _settle(self) -> None:
        """Checks and lets go of the requests already complete (their buffers with them)."""
        done: list[tuple[Any, str, torch.Tensor | None]] = []
        going: list[tuple[Any, str, torch.Tensor | None]] = []
        for pending in self._pending:  # one look at each: it may complete meanwhile
            (done if pending[0].is_completed() else going).append(pending)
        self._pending = going
        for work, what, _ in done:
            wait_work(work, self.wait_timeout, what, self.board)

    def drop(self) -> None:
        """Forgets every request in flight (so a failed step's groups can be torn down)."""
        self.control.drop()
        self._pending.clear()
        self._posted.clear()
        self.payload_group = None
