"""NCCL's rules, written down so that a CPU run can be checked against them.

**The rule.** NCCL runs a rank's point-to-point operations with one peer on one stream, in the
order the rank issued them, and each blocks until its match runs on the peer (the k-th send
from a to b matches the k-th receive at b from a, and both must move the same bytes); a
collective completes once every member runs it. Each process group is a communicator of its
own: the k-th collective of a group matches the k-th of the same group on every member, never
one of another group, even of a group with the same members (two groups over ranks 0 and 1,
issued A then B on rank 0 and B then A on rank 1, wait for each other for ever).
:func:`replay` takes each rank's device operations as issued and plays them in the strictest
reading of that rule: a rank runs one operation at a time, in issue order, across all its
peers and groups. If the replay completes, no interleaving of streams can deadlock; if it
cannot, it names every rank's waiting operation.

**The stand-in.** :class:`FakeNetwork` replaces ``torch.distributed.isend``/``irecv`` inside
one process: ranks are threads, messages match by (group, source, destination, tag) in order,
sizes must agree (NCCL's and gloo's requirement), and every operation is logged per rank. The
mailboxes then run unchanged on threads, with nothing but Python in between.

Example::

    net = FakeNetwork(world=2)
    with net.installed():
        ...                         # threads call net.as_rank(r), then use dist.isend / irecv
    replay(net.device_ops(payload_tags={2}))
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DeviceOp:
    """One operation a rank issued: a send or receive with ``peer``, or a collective on
    ``group`` (its members' global ranks); ``comm`` names the process group (communicator) it
    runs on; ``nbytes`` must agree with the match."""

    kind: str  # "send" | "recv" | "collective"
    peer: int = -1
    group: tuple[int, ...] = ()
    nbytes: int = 0
    what: str = ""
    comm: str = ""

    def __str__(self) -> str:
        on = f" on group {self.comm}" if self.comm else ""
        if self.kind == "collective":
            return f"{self.what} over {list(self.group)}{on} ({self.nbytes} B)"
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} {self.what} {way} rank {self.peer}{on}"


class Deadlock(AssertionError):
    """The replay stopped with operations left; the message lists each rank's next one."""


def _match_ids(ops: dict[int, list[DeviceOp]]) -> dict[tuple[int, int], Any]:
    """(rank, index) -> what it must meet: ("p2p", comm, src, dst, k) or ("coll", comm, group,
    k): keyed by the communicator, so one group's operations never meet another's."""
    ids: dict[tuple[int, int], Any] = {}
    for rank, sequence in ops.items():
        counts: dict[Any, int] = defaultdict(int)
        for i, op in enumerate(sequence):
            if op.kind == "collective":
                base: Any = ("coll", op.comm, op.group)
            elif op.kind == "send":
                base = ("p2p", op.comm, rank, op.peer)
            else:
                base = ("p2p", op.comm, op.peer, rank)
            ids[(rank, i)] = (*base, counts[base])
            counts[base] += 1
    return ids


def replay(ops: dict[int, list[DeviceOp]]) -> int:
    """Plays every rank's operations under the strict rule; returns how many completed.

    Raises :class:`Deadlock` naming each rank's waiting operation, or AssertionError when a
    matched pair disagrees in size.

    >>> replay({0: [DeviceOp("send", 1, nbytes=8)], 1: [DeviceOp("recv", 0, nbytes=8)]})
    1
    """
    ids = _match_ids(ops)
    where: dict[Any, list[tuple[int, int]]] = defaultdict(list)
    for (rank, i), ident in ids.items():
        where[ident].append((rank, i))
    cursor = {rank: 0 for rank in ops}
    done = 0
    while True:
        progressed = False
        for rank, sequence in ops.items():
            if cursor[rank] >= len(sequence):
                continue
            ident = ids[(rank, cursor[rank])]
            parts = where[ident]
            needed = len(ident[2]) if ident[0] == "coll" else 2
            if len(parts) < needed or any(cursor[r] != i for r, i in parts):
                continue
            sizes = {ops[r][i].nbytes for r, i in parts}
            assert len(sizes) == 1, f"matched operations disagree in size: {ident} {sizes}"
            for r, _ in parts:
                cursor[r] += 1
            done += 1
            progressed = True
        if all(cursor[r] >= len(s) for r, s in ops.items()):
            return done
        if not progressed:
            waiting = [
                f"rank {r}: {ops[r][c]} (op {c + 1} of {len(ops[r])})"
                for r, c in sorted(cursor.items())
                if c < len(ops[r])
            ]
            raise Deadlock("no rank can go on; waiting: " + "; ".join(waiting))


# ---- the in-process stand-in -------------------------------------------------------------------


class FakeWork:
    """A request that completes when its match arrives (or fails on a size mismatch)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Exception | None = None

    def complete(self, error: Exception | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else 60.0
        if not self._done.wait(seconds):
            raise RuntimeError(f"Timed out waiting {seconds:g}s for a fake message")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


@dataclass
class Logged:
    """What a rank issued: ``kind`` with ``peer`` on ``tag`` of ``group``, ``nbytes``."""

    kind: str
    peer: int
    tag: int
    group: Any
    nbytes: int


class FakeNetwork:
    """``dist.isend``/``dist.irecv`` between threads of one process (see the module
    docstring). A thread says which rank it is with :meth:`as_rank`."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._lock = threading.Lock()
        self._sends: dict[Any, deque[tuple[torch.Tensor, FakeWork]]] = defaultdict(deque)
        self._recvs: dict[Any, deque[tuple[torch.Tensor, FakeWork]]] = defaultdict(deque)
        self._local = threading.local()
        self.log: dict[int, list[Logged]] = defaultdict(list)

    def as_rank(self, rank: int) -> None:
        self._local.rank = rank

    @property
    def rank(self) -> int:
        return int(self._local.rank)

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> FakeWork:
        src, work = self.rank, FakeWork()
        data = tensor.detach().clone()
        with self._lock:
            self.log[src].append(Logged("send", dst, tag, group, _nbytes(tensor)))
            channel = (id(group), src, dst, tag)
            if self._recvs[channel]:
                buffer, other = self._recvs[channel].popleft()
                _deliver(data, buffer, work, other)
            else:
                self._sends[channel].append((data, work))
        return work

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> FakeWork:
        dst, work = self.rank, FakeWork()
        with self._lock:
            self.log[dst].append(Logged("recv", src, tag, group, _nbytes(tensor)))
            channel = (id(group), src, dst, tag)
            if self._sends[channel]:
                data, other = self._sends[channel].popleft()
                _deliver(data, tensor, other, work)
            else:
                self._recvs[channel].append((tensor, work))
        return work

    def run(
        self, rank_main: Callable[[int], None], ranks: int = 2, timeout: float = 30
    ) -> list[int]:
        """``rank_main(rank)`` on a thread per rank with this network installed; the ranks
        still running after ``timeout`` s (hung)."""
        with self.installed():
            threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
        return [r for r, t in enumerate(threads) if t.is_alive()]

    @contextlib.contextmanager
    def installed(self) -> Iterator[FakeNetwork]:
        """``torch.distributed.isend``/``irecv`` are this network's while inside."""
        real = dist.isend, dist.irecv
        dist.isend, dist.irecv = self.isend, self.irecv  # type: ignore[assignment]
        try:
            yield self
        finally:
            dist.isend, dist.irecv = real  # type: ignore[assignment]

    def device_ops(self, tags: Iterable[int], group: Any = None) -> dict[int, list[DeviceOp]]:
        """Each rank's operations on ``tags`` (of ``group`` if given), as :func:`replay`
        takes them."""
        wanted = set(tags)
        return {
            rank: [
                DeviceOp(e.kind, e.peer, nbytes=e.nbytes, what=f"tag {e.tag}", comm=_name(e.group))
                for e in entries
                if e.tag in wanted and (group is None or e.group is group)
            ]
            for rank, entries in self.log.items()
        }


def _name(group: Any) -> str:
    """A stand-in group's name: its identity (the default group's is empty)."""
    return "" if group is None else f"{id(group):x}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _deliver(data: torch.Tensor, buffer: torch.Tensor, send: FakeWork, recv: FakeWork) -> None:
    if _nbytes(data) != _nbytes(buffer):
        error = RuntimeError(f"size mismatch: {_nbytes(data)} B sent into {_nbytes(buffer)} B")
        send.complete(error)
        recv.complete(error)
        return
    buffer.view(-1).view(torch.uint8).copy_(data.reshape(-1).view(torch.uint8))
    send.complete()
    recv.complete()
