"""The executor's mailbox across processes: boundary values as bare bytes, in one agreed order.

:class:`P2PMailbox` keeps the local :class:`~giantpipe.engine.mailbox.Mailbox`'s interface, so the
very same ``StepRun`` drives one rank of a distributed pipeline, on gloo (CPU) and NCCL (GPUs)
alike: the one transport. A step starts with one host message from stage 0's rank; then every
transfer is issued in :func:`~.message_order.worker_ops`'s order, descriptions only in the first
step of an input layout. A step's messages, and what NCCL asks: docs/engine.md#the-transport.

Example (on each rank; ``layouts`` lives as long as the pipe)::

    box = P2PMailbox(layout, groups.control, groups.p2p, 60.0, board, device, layouts)
    seed = box.start(schedule.actions, seed, inputs)   # stage 0's rank; others pass None
    run = StepRun(config, micro_batches if layout.needs_inputs else [], mailbox=box)
    run.run(my_schedule)
    box.finish(); box.check()    # check after the step's device wait: every transfer succeeded
"""

from __future__ import annotations

import datetime
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.engine.distributed.faults import FailureBoard, RankFailure, explain, wait_work
from giantpipe.engine.distributed.layout import Layout
from giantpipe.engine.distributed.message_order import Op, worker_ops
from giantpipe.engine.distributed.wire import (
    DESCRIPTION_WORDS,
    Frame,
    Layouts,
    description,
    encode,
    pack,
    render,
    unpack,
    words_left,
    words_of,
)
from giantpipe.engine.mailbox import Key, Mailbox
from giantpipe.engine.schedules.actions import Action

STARTS, DESCRIPTIONS, PAYLOADS = 0, 1, 2  # tags: on CPU the host and device groups are one
# Receives kept issued ahead where the order allows: the next values can land while the rank
# computes. More only while it waits anyway: issuing one costs the rank tens of microseconds.
AHEAD = 2


def describe(key: Key) -> str:
    kind, _, m = key
    return f"the {'activation' if kind == 'act' else 'gradient'} of micro-batch {m}"


def wait_receive(
    work: Any, what: str, peer: int, layout: Layout, timeout: float, board: FailureBoard | None
) -> None:
    """Waits (host) for a receive of ``what`` from rank ``peer``; a failure raises RankFailure
    naming the peer: it timed out, its connection closed, it was aborted, or what the backend
    said.

    Example::

        wait_receive(work, "the activation of micro-batch 0", 0, layout, 60.0, board)
    """
    me, them = layout.label(), layout.rank_label(peer)
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - becomes a message naming the peer
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Timed out" in text:
            local = f"{me} timed out after {timeout:.0f}s waiting for {what} from {them}"
        elif "closed" in text.lower() or "reset" in text.lower():
            local = f"{them} is gone (connection closed); {me} waited for {what}"
        else:
            local = f"{me} failed to receive {what} from {them}: {text}"
        raise RankFailure(explain(board, local)) from exc
    if done is False:  # aborted (see faults.wait_work): the buffer is not the message
        raise RankFailure(explain(board, f"{me}: the receive of {what} from {them} was aborted"))


@dataclass
class _Posted:
    """A receive issued for a value: its frame, and (when it has bytes) buffer and request."""

    frame: Frame
    buffer: torch.Tensor | None
    work: Any


class P2PMailbox(Mailbox):
    """A mailbox across ranks whose transfers follow the step's agreed order (one step's).

    ``host`` is a gloo group of every rank (step starts, descriptions), ``group`` the device
    group of every rank (the bytes; the same gloo group on CPU); ``device`` is where the bytes
    live (``layout.comm_device`` of the pipe's device); ``layouts`` lives as long as the pipe.
    """

    def __init__(
        self,
        layout: Layout,
        host: Any,
        group: Any,
        timeout: float,
        board: FailureBoard | None = None,
        device: torch.device | None = None,
        layouts: Layouts | None = None,
    ) -> None:
        super().__init__(timeout)
        self.layout, self.host, self.group, self.wait_timeout = layout, host, group, timeout
        self.board = board
        self.device = device or torch.device("cpu")
        self.layouts = layouts if layouts is not None else Layouts()
        self.seed: int | None = None
        self._learning = False
        self._frames: dict[Key, Frame] = {}
        self._ops: tuple[Op, ...] = ()
        self._index: dict[tuple[str, Key], int] = {}
        self._issued = 0  # self._ops[: self._issued] are issued
        self._posted: dict[Key, _Posted] = {}
        # Host messages on their way: (request, what it sends, the bytes it keeps alive).
        self._host_sends: list[tuple[Any, str, torch.Tensor]] = []
        # Transfers of bytes not yet checked (request, what it moves, the bytes of a send).
        self._pending: list[tuple[Any, str, torch.Tensor | None]] = []

    def start(
        self,
        actions: Sequence[Sequence[Action]],
        seed: int | None = None,
        inputs: Hashable | None = None,
    ) -> int:
        """Starts a step of ``actions`` (every worker's); returns its seed. The rank holding
        stage 0 gives the seed and the layout of the step's inputs and tells the others of its
        pipeline, which wait for it here."""
        plan = tuple(map(tuple, actions))
        self._ops = worker_ops(plan, self.layout.placement, self.layout.worker)
        self._index = {(op.kind, op.key): i for i, op in enumerate(self._ops)}
        self._issued = 0
        self.layouts.steps += 1
        if self.layout.needs_inputs:
            if seed is None or inputs is None:
                raise ValueError("the rank holding stage 0 starts a step with its seed and inputs")
            slot, new = self.layouts.slot_of(inputs)
            head = torch.tensor([self.layouts.steps, seed, slot, int(new)], dtype=torch.int64)
            for peer in self.layout.pipeline_ranks:
                if peer != self.layout.rank:
                    self._send_host(head, peer, STARTS, f"the start of step {self.layouts.steps}")
        else:
            seed, slot, new = self._receive_start()
        self.seed, self._learning = seed, new
        self._frames = self.layouts.of_step(slot, new)
        self._keep_ahead()
        return seed

    def _receive_start(self) -> tuple[int, int, bool]:
        head = torch.empty(4, dtype=torch.int64)
        first = self.layout.rank_of_stage(0)
        work = dist.irecv(head, src=first, group=self.host, tag=STARTS)
        what = f"the start of step {self.layouts.steps}"
        wait_receive(work, what, first, self.layout, self.wait_timeout, self.board)
        step, seed, slot, new = head.tolist()
        if step != self.layouts.steps:
            local = (
                f"{self.layout.label()} got the start of step {step} from "
                f"{self.layout.rank_label(first)}, in its step {self.layouts.steps}: are all "
                "ranks running the same steps?"
            )
            raise RankFailure(explain(self.board, local))
        return seed, slot, bool(new)

    def _post_ahead(self, most: int, waiting: Any = None) -> None:
        """Issues up to ``most`` of the next receives of the order, never past a send (nor
        any while layouts are learned: each would wait for its description); with
        ``waiting``, only while that request is not complete."""
        while (
            most > 0
            and not self._learning
            and self._issued < len(self._ops)
            and self._ops[self._issued].kind == "recv"
            and (waiting is None or not waiting.is_completed())
        ):
            self._post(self._ops[self._issued])
            self._issued += 1
            most -= 1

    def _keep_ahead(self) -> None:
        self._post_ahead(AHEAD - len(self._posted))

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
        dst = self._peer(self._ops[position].peer)
        frame = self._frames.get(key)
        if self._learning:
            # The description first: the peer may wait for it to issue earlier receives.
            frame = self._frames[key] = Frame.of(words)
            for part in description(words):
                self._send_host(part, dst, DESCRIPTIONS, f"the description of {describe(key)}")
        elif frame is None or frame.words != tuple(words):
            raise RuntimeError(self._changed(key, frame, words))
        self._issue_until(position)
        if frame.nbytes:
            message = pack(frame, tensors, self.device)
            work = dist.isend(message, dst=dst, group=self.group, tag=PAYLOADS)
            self._settle()
            to = self.layout.label(key[1])
            self._pending.append((work, f"sending {describe(key)} to {to}", message))
        self._issued = position + 1
        self._keep_ahead()

    def _changed(self, key: Key, frame: Frame | None, words: list[int]) -> str:
        was = "none" if frame is None else render(frame.words)
        return (
            f"{self.layout.label()}: {describe(key)} is {render(words)}, in a step whose "
            f"inputs have the layout of an earlier step, where it was {was}: a boundary "
            "value's dtypes, shapes and plain items must follow the layout of the step's inputs"
        )

    def _send_host(self, message: torch.Tensor, dst: int, tag: int, what: str) -> None:
        work = dist.isend(message, dst=dst, group=self.host, tag=tag)
        self._host_sends.append((work, f"sending {what} to {self.layout.rank_label(dst)}", message))

    # ---- receiving -------------------------------------------------------------------------

    def _post(self, op: Op) -> None:
        """Issues the receive of ``op``'s bytes (their layout learned first if need be)."""
        src = self._peer(op.peer)
        if self._learning:
            self._frames[op.key] = Frame.of(self._receive_description(op.key, src))
        frame = self._frames.get(op.key)
        if frame is None:
            raise RuntimeError(f"{self.layout.label()} knows no layout of {describe(op.key)}")
        buffer = work = None
        if frame.nbytes:
            buffer = torch.empty(frame.nbytes, dtype=torch.uint8, device=self.device)
            work = dist.irecv(buffer, src=src, group=self.group, tag=PAYLOADS)
        self._posted[op.key] = _Posted(frame, buffer, work)

    def _receive_description(self, key: Key, src: int) -> list[int]:
        what = f"the description of {describe(key)}"
        head = torch.empty(DESCRIPTION_WORDS, dtype=torch.int64)
        work = dist.irecv(head, src=src, group=self.host, tag=DESCRIPTIONS)
        wait_receive(work, what, src, self.layout, self.wait_timeout, self.board)
        rest = None
        if words_left(head):
            rest = torch.empty(words_left(head), dtype=torch.int64)
            work = dist.irecv(rest, src=src, group=self.host, tag=DESCRIPTIONS)
            wait_receive(work, what, src, self.layout, self.wait_timeout, self.board)
        return words_of(head, rest)

    def get(self, key: Key) -> Any:
        position = self._index.get(("recv", key))
        if position is None:
            return super().get(key)
        self._issue_until(position + 1)
        posted = self._posted.pop(key)
        if posted.buffer is None:
            return unpack(posted.frame, torch.empty(0, dtype=torch.uint8, device=self.device))
        self._post_ahead(len(self._ops), waiting=posted.work)  # time spent waiting anyway
        self._settle()
        if self._on_device():  # the stream waits; the request is checked later (check)
            posted.work.wait()
            producer = self.layout.label(key[1] - 1 if key[0] == "act" else key[1] + 1)
            self._pending.append((posted.work, f"receiving {describe(key)} from {producer}", None))
        else:  # gloo: the host waits, under the timeout, naming the peer
            peer = self._peer(self._ops[position].peer)
            what = describe(key)
            wait_receive(posted.work, what, peer, self.layout, self.wait_timeout, self.board)
        self._keep_ahead()
        return unpack(posted.frame, posted.buffer)

    def _on_device(self) -> bool:
        """Whether the bytes move by device operations (NCCL), which a wait without a timeout
        only orders on the stream, rather than the host's (gloo: a request is waited once)."""
        return self.device.type == "cuda"

    # ---- the end of a step -----------------------------------------------------------------

    def finish(self) -> None:
        """Waits until this step's host messages are through, and its transfers where gloo
        carries them (on CUDA the step's end waits for the device, then :meth:`check`)."""
        sends, self._host_sends = self._host_sends, []
        for work, what, _ in sends:
            wait_work(work, self.wait_timeout, what, self.board)
        if not self._on_device():
            self.check()
        self._posted.clear()

    def check(self) -> None:
        """Raises :class:`~giantpipe.engine.distributed.faults.RankFailure` naming the peer
        unless every transfer of the step not yet waited on the host succeeded (on CUDA: call
        it after the step's device wait, when each has run; each is waited on the host under
        the timeout, once: a gloo request cannot be waited on twice)."""
        pending, self._pending = self._pending, []
        for work, what, _ in pending:
            wait_work(work, self.wait_timeout, what, self.board)

    def _settle(self) -> None:
        """Checks and lets go of the transfers already complete (their buffers with them)."""
        done: list[tuple[Any, str, torch.Tensor | None]] = []
        going: list[tuple[Any, str, torch.Tensor | None]] = []
        for pending in self._pending:  # one look at each: it may complete meanwhile
            (done if pending[0].is_completed() else going).append(pending)
        self._pending = going
        for work, what, _ in done:
            wait_work(work, self.wait_timeout, what, self.board)

    def drop(self) -> None:
        """Forgets every request in flight (so a failed step's groups can be torn down)."""
        self._host_sends.clear()
        self._pending.clear()
        self._posted.clear()
        self.host = self.group = None
