"""The ring of stages that generation circles: one worker's stages served from one inbox, the
ring between the threads of one process, and what a ring between processes must offer.

A worker serves its messages in one order (token step, stage, micro-batch) whatever order they
arrive in; between threads the link is a :class:`LocalLink`, between processes the pipe's
:class:`ProcessRing` (docs/generation.md#inside-the-ring-and-its-messages).

Example::

    >>> held_stages((0, 1, 1, 0), 1)   # zb-v, K = 2: worker 1 holds stages 1 and 2
    [1, 2]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from giantpipe.engine.generate.caches import StageCaches
from giantpipe.engine.generate.decoding import Decoding, Message, Tokens
from giantpipe.engine.generate.search import Searches
from giantpipe.engine.mailbox import Mailbox
from giantpipe.engine.workers import WorkerPool

__all__ = [
    "Link",
    "LocalLink",
    "LocalPost",
    "ProcessRing",
    "StageServer",
    "generate_local",
    "held_stages",
    "serve_held_stages",
]

Task = Callable[[], None]


class Link(Protocol):
    """A worker's ends of the ring: a message goes to the worker of ``message.stage``;
    ``receive`` takes the next message sent to any of this worker's stages."""

    def send(self, message: Message) -> None: ...

    def receive(self) -> Message: ...


class StageServer:
    """One worker's stages (``stages``: index -> its caches, of ``count`` in the ring) for one
    call of ``micro_batches`` micro-batches (every worker of the ring knows the number): each
    stage serves each micro-batch once per token step until the micro-batch is done.

    Messages are served in one order, whatever order they arrive in: by token step, then
    stage, then micro-batch (:meth:`_next`). It is the ring's own order where a worker hears
    one sender, and it keeps every worker's gathers in the same sequence as its replicas'
    (lockstep, ``goes_on``); it can never wait on itself, since every message a step depends
    on comes before it in that order. ``goes_on(going)``: whether a micro-batch takes another
    step, as the replicas agree (a replica whose micro-batch is done then walks it round the
    ring as a ghost, see :class:`~giantpipe.engine.generate.decoding.Message`); alone: itself.

    Example::

        StageServer({0: first, 2: third}, 4, link, prompts, None, 2).serve()   # worker 0 of 2
    """

    def __init__(
        self,
        stages: dict[int, StageCaches],
        count: int,
        link: Link,
        prompts: Sequence[Message],
        searches: Searches | None,
        micro_batches: int,
        goes_on: Callable[[bool], bool] = bool,
    ) -> None:
        self.stages, self.count, self.link, self.searches = stages, count, link, searches
        self.goes_on = goes_on
        # (stage, m) -> the step it serves next, while m is not done there
        self.steps = {(s, m): 0 for s in stages for m in range(micro_batches)}
        self.waiting: dict[tuple[int, int], Message] = {}
        if 0 in stages:  # prompts go in at stage 0 only; beyond this replica's own, ghosts
            for m in range(micro_batches):
                ghost = Message(m, None, ghost=True)
                self.waiting[0, m] = prompts[m] if m < len(prompts) else ghost

    def serve(self) -> None:
        while self.steps:
            s, m = self._next()
            message = self.waiting.pop((s, m), None)
            while message is None:
                self._keep(self.link.receive())
                message = self.waiting.pop((s, m), None)
            self.steps[s, m] += 1
            self._handle(message)

    def _next(self) -> tuple[int, int]:
        """The (stage, micro-batch) served next: the lowest (step, stage, micro-batch)."""
        return min(self.steps, key=lambda key: (self.steps[key], *key))

    def _keep(self, message: Message) -> None:
        key = (message.stage, message.m)
        assert key not in self.waiting, f"two messages for stage {key[0]}, micro-batch {key[1]}"
        self.waiting[key] = message

    def _send(self, message: Message) -> None:
        if message.stage in self.stages:
            self._keep(message)
        else:
            self.link.send(message)

    def _pass_on(self, message: Message) -> None:
        if message.stage < self.count - 1:  # the last stage is where the word stops
            self._send(replace(message, stage=message.stage + 1))

    def _handle(self, message: Message) -> None:
        s, m, last = message.stage, message.m, message.stage == self.count - 1
        if message.ghost:
            self.stages[s].idle()
            if last:
                self._reply(Message(m, None))
            else:
                self._pass_on(message)
        elif message.value is None:  # m is done: its caches go, and the word goes on
            self.stages[s].drop(m)
            del self.steps[s, m]
            self._pass_on(message)
        elif last:  # the logits: the search picks the next tokens
            out = self.stages[s].run(m, message.value, message.order)
            assert self.searches is not None
            self._reply(self.searches.advance(Message(m, out, steps=message.steps)))
        else:
            out = self.stages[s].run(m, message.value, message.order)
            self._send(Message(m, out, message.order, message.steps, stage=s + 1))

    def _reply(self, reply: Message) -> None:
        """The last stage's answer to stage 0: the next tokens, the end of the micro-batch, or
        (done here, not in every replica) another ghost step."""
        going = reply.value is not None
        if self.goes_on(going) and not going:
            self._send(Message(reply.m, None, ghost=True, stage=0))
        else:
            self._send(replace(reply, stage=0))


class LocalPost:
    """The ring between worker threads of one process: a :class:`Mailbox` keyed by receiving
    worker and arrival number. A worker holding several stages hears several senders, so the
    number is drawn under a lock by whoever sends (each sender's messages keep their order)."""

    def __init__(self, box: Mailbox, placement: Sequence[int]) -> None:
        self.box, self.placement = box, list(placement)
        self.sent = [0] * (max(self.placement) + 1)
        self.lock = threading.Lock()

    def send(self, message: Message) -> None:
        worker = self.placement[message.stage]
        with self.lock:
            self.box.put(("act", worker, self.sent[worker]), message)
            self.sent[worker] += 1


class LocalLink:
    """Worker ``worker``'s ends of a :class:`LocalPost`."""

    def __init__(self, post: LocalPost, worker: int) -> None:
        self.post, self.worker, self.received = post, worker, 0

    def send(self, message: Message) -> None:
        self.post.send(message)

    def receive(self) -> Message:
        message: Message = self.post.box.get(("act", self.worker, self.received))
        self.received += 1
        return message


def _threads(devices: Sequence[torch.device]) -> int | None:
    cpu = sum(d.type == "cpu" for d in devices)
    return max(1, torch.get_num_threads() // cpu) if cpu > 1 else None


def _worker(
    task: Callable[[], None], device: torch.device, threads: int | None
) -> Callable[[], None]:
    def run() -> None:
        before = torch.get_num_threads()
        if threads is not None and device.type == "cpu":
            torch.set_num_threads(threads)  # stand-ins share the cores, as the executor's
        try:
            with torch.no_grad():
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        task()
                else:
                    task()
        finally:
            torch.set_num_threads(before)  # as the executor's workers: the count given back

    return run


def held_stages(placement: Sequence[int], worker: int) -> list[int]:
    """The stages ``worker`` holds, in ring order.

    >>> held_stages((0, 1, 1, 0), 0)   # zb-v, K = 2
    [0, 3]
    """
    return [s for s, w in enumerate(placement) if w == worker]


def generate_local(
    stages: Sequence[StageCaches],
    placement: Sequence[int],
    prompts: list[Message],
    decoding: Decoding,
    timeout: float,
) -> dict[int, Tokens]:
    box, searches = Mailbox(timeout), Searches(decoding)
    post, workers = LocalPost(box, placement), sorted(set(placement))
    devices = [stages[held_stages(placement, w)[0]].device for w in workers]
    threads = _threads(devices)

    def task(w: int) -> Task:
        held = {s: stages[s] for s in held_stages(placement, w)}

        def serve() -> None:
            link = LocalLink(post, w)
            StageServer(held, len(stages), link, prompts, searches, len(prompts)).serve()

        return _worker(serve, devices[w], threads)

    tasks = [task(w) for w in workers]
    if len(tasks) == 1:
        tasks[0]()  # the caller's thread: nothing to overlap
    else:
        pool = WorkerPool()
        try:
            pool.run(tasks, timeout)
        except BaseException:
            box.abort()
            raise
        finally:
            pool.close()
    return searches.results


class ProcessRing(Link, Protocol):
    """This process's ends of a ring spread over processes, as the pipe gives them
    (``pipe.generation_link(timeout)``; a DistributedPipe's is
    :class:`giantpipe.engine.distributed.generation.RankLink`): the stages of the ring (``count``),
    those this process holds (``held``), what every process agrees on (``micro_batches``,
    ``goes_on``: collectives), how a layer's parameters are held while it runs (``hold``), a
    wait for this process's sends (``finish``), and the last stage's results handed to every
    process of the pipeline (``share``)."""

    count: int
    held: list[int]

    def micro_batches(self, own: int) -> int:
        """How many micro-batches every stage serves, given this process's own prompts."""
        ...

    def goes_on(self, going: bool) -> bool:
        """At the last stage: whether a micro-batch takes another step (``going``: here)."""
        ...

    def hold(self, layer: nn.Module) -> AbstractContextManager[Any]: ...

    def finish(self) -> None: ...

    def share(self, results: dict[int, Tokens]) -> dict[int, Tokens]: ...


def serve_held_stages(
    pipe: Any, link: ProcessRing, prompts: list[Message], decoding: Decoding
) -> dict[int, Tokens]:
    """This process's stages of a ring across processes (``pipe.partitions[s]`` on
    ``pipe.device``); the last stage's results, shared with every process of the pipeline."""
    held = {
        s: StageCaches(list(pipe.partitions[s].children()), pipe.device, link.hold)
        for s in link.held
    }
    searches = Searches(decoding) if link.count - 1 in held else None
    count = link.micro_batches(len(prompts) if 0 in held else 0)
    with torch.no_grad():
        StageServer(held, link.count, link, prompts, searches, count, link.goes_on).serve()
    link.finish()
    return link.share(searches.results if searches is not None else {})
