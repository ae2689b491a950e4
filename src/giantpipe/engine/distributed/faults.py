"""Failures across processes: the first one is written down once, every rank reads it.

A failing rank reports one line on the failure board (:class:`FailureBoard`, a key in torchrun's
store); the first report wins, later ones are told the root cause, and every rank raises
:class:`RankFailure` with it. How the failure ripples through the ranks, and how a rank that died
without a word is named: docs/engine-internals.md#failures-across-ranks.

    >>> board = FailureBoard(dist.HashStore(), label="rank 0 (stage 0)")
    >>> board.report("rank 1 (stage 1) failed on micro-batch 2: ValueError: boom")
    'rank 1 (stage 1) failed on micro-batch 2: ValueError: boom'
    >>> board.report("rank 0 (stage 0): rank 1 (stage 1) is gone (connection closed)")
    'rank 1 (stage 1) failed on micro-batch 2: ValueError: boom'
    >>> board.read()   # the first report, from any rank
    'rank 1 (stage 1) failed on micro-batch 2: ValueError: boom'
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from giantpipe.engine.failures import PipelineError, failed_action

_KEY, _CLAIM, _PROCESS = "giantpipe/failed", "giantpipe/failed_claim", "giantpipe/process"
GRACE_S = 1.0  # how long a consequence waits for its cause to show (a report, a dead peer)
# What a transport error says (gloo, NCCL, sockets): a consequence of a peer's failure.
_TRANSPORT = re.compile(r"connection|by peer|broken pipe|socket|gloo|nccl|timed out", re.I)
T = TypeVar("T")


class RankFailure(PipelineError):
    """A rank of the distributed pipeline failed; the message names the first rank and stage.

    Every rank raises it (the failing rank too, with its own exception as ``__cause__``): all
    take the same path, and the pipe cannot run again (its groups are torn down).
    """


class FailureBoard:
    """Reads and writes the first failure of the run in a c10d store (thread-safe)."""

    def __init__(self, store: Any, label: str) -> None:
        self.store = store
        self.label = label  # "rank r (stage s)", to prefix what this rank reports
        self.peers: list[int] = []
        self.label_of: Callable[[int], str] = lambda rank: f"rank {rank}"

    def watch(self, rank: int, peers: Iterable[int], label_of: Callable[[int], str]) -> None:
        """Writes this process's host and pid on the board, and remembers the ``peers`` whose
        death would stop this rank (those it exchanges data with).

        Example::

            peers = layout.pipeline_ranks + layout.replica_ranks
            board.watch(layout.rank, peers, layout.rank_label)
        """
        self.peers, self.label_of = sorted(set(peers) - {rank}), label_of
        try:
            self.store.set(f"{_PROCESS}/{rank}", f"{socket.gethostname()} {os.getpid()}")
        except Exception:  # noqa: BLE001, S110 - without it, a death is named by its neighbours
            pass

    def gone(self) -> str | None:
        """``"rank 1 (stage 1) is gone (process 4242 ended)"`` for the first watched peer on
        this host whose process ended, else None."""
        host = socket.gethostname()
        for rank in self.peers:
            try:
                key = f"{_PROCESS}/{rank}"
                if not self.store.check([key]):
                    continue
                peer_host, pid = bytes(self.store.get(key)).decode().split()
            except Exception:  # noqa: BLE001 - an unreachable store: nothing to tell
                return None
            if peer_host == host and _process_ended(int(pid)):
                return f"{self.label_of(rank)} is gone (process {pid} ended)"
        return None

    def blame(self, local: str, grace: float = GRACE_S) -> str:
        """``local``, led by the peer whose process ended if one did (waiting up to ``grace``
        seconds for a death or a report to show: a dying process closes its connections just
        before it ends, and a report comes before the teardown that wakes this rank)."""
        deadline = time.monotonic() + grace
        while self.read() is None:
            dead = self.gone()
            if dead is not None:
                named = dead.split(" (process")[0]  # "rank 1 (stage 1) is gone"
                return local if named in local else f"{dead}; then {local}"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return local

    def report(self, message: str) -> str:
        """Records ``message`` unless another rank was first; returns the first failure."""
        try:
            if self.store.add(_CLAIM, 1) == 1:
                self.store.set(_KEY, message)
                return message
            deadline = time.monotonic() + 2.0  # the first reporter is between add and set
            while time.monotonic() < deadline:
                first = self.read()
                if first is not None:
                    return first
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
            pass
        return message

    def read(self) -> str | None:
        """The first failure reported by any rank, or None."""
        try:
            if self.store.check([_KEY]):
                return bytes(self.store.get(_KEY)).decode()
        except Exception:  # noqa: BLE001 - an unreachable store is not itself a failure report
            return None
        return None


def explain(board: FailureBoard | None, local: str, consequence: bool = True) -> str:
    """The message to raise: the first failure, plus what this rank saw if that differs.

    ``consequence``: what this rank saw may have been caused by another rank (a closed
    connection, a timeout); the board then names a dead peer first (:meth:`FailureBoard.blame`).
    """
    if board is None:
        return local
    if consequence:
        local = board.blame(local)
    first = board.report(local)
    if first == local:
        return first
    seen = local if local.startswith(board.label) else f"on {board.label}: {local}"
    return f"{first} [then {seen}]"


def failure_message(exc: BaseException, layout: Any, board: FailureBoard | None) -> str:
    """The one line a failed step raises: the first failure of the run, named by rank and stage.

    ``exc`` is what this rank caught: a :class:`RankFailure` (already explained), an exception
    of one of its own actions (the executor noted which), or anything else raised in the step.
    A transport error (a peer's connection reset) or a timeout is blamed on its cause, not on
    this rank, when that cause can be found (see :func:`explain`).
    """
    if isinstance(exc, RankFailure):
        return str(exc)
    action = failed_action(exc)
    line = str(exc).splitlines()[0] if str(exc) else ""  # the board holds one line
    text = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    if action is not None:
        local = f"{layout.label(action.stage)} failed on micro-batch {action.microbatch}: {text}"
    else:
        local = f"{layout.label()} failed: {text}"
    return explain(board, local, consequence=is_consequence(exc))


def is_consequence(exc: BaseException) -> bool:
    """Whether ``exc`` may come from another rank's failure: an error of torch.distributed or
    of its transport, or the engine's own (a wait that timed out)."""
    if isinstance(exc, (dist.DistError, PipelineError)):
        return True
    return isinstance(exc, RuntimeError) and _TRANSPORT.search(str(exc)) is not None


def _process_ended(pid: int) -> bool:
    # A killed process stays a zombie until its parent reaps it: "Z" (or "X") in /proc counts.
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def run_guarded(
    body: Callable[[], T], layout: Any, board: FailureBoard | None, teardown: Callable[[str], None]
) -> T:
    """Runs a step; on any failure: report it, ``teardown(message)``, raise RankFailure.

    Tearing down closes this rank's connections, so every rank waiting on it wakes at once.
    Interrupts (KeyboardInterrupt, SystemExit) are re-raised as they are, after the teardown.

    Example::

        loss = run_guarded(lambda: pipe._step(...), pipe.layout, pipe.board, pipe._teardown)
    """
    try:
        return body()
    except BaseException as exc:
        message = failure_message(exc, layout, board)
        clear_frames(exc)  # locals of the failed frames hold requests of the groups
        teardown(message)
        if not isinstance(exc, Exception) or isinstance(exc, RankFailure):
            raise
        raise RankFailure(message) from exc


def clear_frames(exc: BaseException) -> None:
    """Drops the locals of every frame in ``exc``'s tracebacks (and its causes').

    The locals of a failed step hold communication requests, which keep their process group's
    connections open; dropping them lets a torn-down group really close.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def wait_work(work: Any, timeout: float, what: str, board: FailureBoard | None) -> None:
    """Waits on the host until a collective or p2p request is done, at most ``timeout``
    seconds; an error, an abort or the timeout raises :class:`RankFailure` naming ``what``.

    Given a timeout, torch's ``Work.wait`` blocks the calling thread on every backend (torch
    2.14's ``c10d/Work.hpp`` and ``ProcessGroupNCCL.hpp``, ``WorkNCCL::wait``):

    - gloo (host groups, every group on CPU): until the request is done or the timeout
      passes. Gloo wakes a waiting request as soon as a peer's connection closes, so a killed
      peer is noticed at once; a peer that is alive but silent is caught by the timeout.
    - NCCL (device groups on CUDA): until the operation has run on the GPU, or the timeout
      passed (it then raises); the current stream is also made to wait for NCCL's. An error
      NCCL's watchdog found is raised; a request whose communicator was aborted returns False
      (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` aborts it at the group's timeout), which is a
      failure here too. Only a wait *without* a timeout returns at once on NCCL, having made
      the stream wait: what the transport does inside a step on CUDA, whose requests are then
      checked with this function after the step's device wait (``P2PMailbox.check``).
    """
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - turned into one message naming the peer
        label = board.label if board is not None else "this rank"
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Timed out" in text or "timeout" in text.lower():
            local = f"{label} timed out after {timeout:.0f}s in {what}"
        elif "closed" in text.lower() or "reset" in text.lower():
            local = f"{label}: a peer is gone (connection closed) during {what}"
        else:
            local = f"{label}: {what} failed: {text}"
        raise RankFailure(explain(board, local)) from exc
    if done is False:  # aborted: its buffers hold whatever arrived before the abort
        label = board.label if board is not None else "this rank"
        raise RankFailure(explain(board, f"{label}: {what} was aborted (communicator torn down)"))


class DeviceEvent(Protocol):
    """What :func:`wait_device` needs of a ``torch.cuda.Event``: whether the stream passed it."""

    def query(self) -> bool: ...


def wait_device(
    event: DeviceEvent,
    timeout: float,
    what: str,
    board: FailureBoard | None,
    poll: float = 1e-3,
) -> None:
    """Waits, on the host, until the device reaches ``event``; after ``timeout`` seconds raises
    :class:`RankFailure` naming this rank and ``what`` (reported on the failure board).

    ``torch.cuda.synchronize`` (or ``event.synchronize()``) would block forever behind an NCCL
    operation whose peer died: the process would wait for NCCL's watchdog instead of naming the
    peer within the pipe's timeout. Polling ``event.query()`` keeps the host in charge. The
    poll starts at a few microseconds and backs off to ``poll`` seconds, so a step that is
    about to end is not held up by a whole poll period.

    Example (at the end of a step, on a GPU)::

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        wait_device(event, 60.0, "the step's kernels on cuda:0", board)
    """
    deadline = time.monotonic() + timeout
    pause = min(1e-5, poll)
    while not event.query():
        if time.monotonic() >= deadline:
            label = board.label if board is not None else "this rank"
            local = f"{label} timed out after {timeout:.0f}s waiting for {what}"
            raise RankFailure(explain(board, local))
        time.sleep(pause)
        pause = min(2 * pause, poll)


def install_sigterm_note(board: FailureBoard) -> None:
    """On SIGTERM (torchrun stopping the survivors), print the first failure, then die of it.

    Only when SIGTERM has its default action and this is the main thread: the process still
    ends by SIGTERM, as the launcher expects, but its log says why.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def note(signum: int, frame: FrameType | None) -> None:
        # What this rank found goes on the board before it dies: a survivor stopped later
        # then reads it, rather than finding this rank's process ended too and naming it.
        found = board.read() or board.gone()
        first = board.report(found) if found else "no failure was reported on the failure board"
        print(
            f"giantpipe {board.label}: stopped by SIGTERM; first failure: {first}",
            file=sys.stderr,
            flush=True,
        )
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, note)


def default_store() -> Any:
    """The default process group's store (torchrun's agent store under torchrun)."""
    return dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor
