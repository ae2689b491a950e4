"""Failures across processes: the first one is written down once, every rank reads it.

A rank that fails (an exception in its stage, a peer whose connection closed, a wait that timed
out) reports a one-line message on the *failure board*, a key in the process group's store
(torchrun's agent store, which outlives the workers). The first report wins; later ones (the
ranks that fell over because of it) are told the root cause::

    rank 1 (stage 1) failed on micro-batch 2: ValueError: boom          <- first report
    rank 0 (stage 0): rank 1 (stage 1) is gone (connection closed) ...   <- seen by a neighbour

A failing rank also tears down its process groups (see ``DistributedPipe``), which closes its
connections: every rank waiting on it wakes at once with "connection closed", fails in turn, and
the failure ripples through the pipeline and the replicas in milliseconds. A peer that is alive
but silent is caught by the timeout. Each rank raises :class:`RankFailure` with the first report.

Example::

    board = FailureBoard(dist.distributed_c10d._get_default_store(), label="rank 0 (stage 0)")
    root = board.report("rank 0 (stage 0) failed on micro-batch 3: ValueError: boom")
    board.read()   # the first report, from any rank
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import torch.distributed as dist

from giantpipe.engine.executor import failed_action
from giantpipe.engine.workers import PipelineError

_KEY, _CLAIM = "giantpipe/failed", "giantpipe/failed_claim"
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


def explain(board: FailureBoard | None, local: str) -> str:
    """The message to raise: the first failure, plus what this rank saw if that differs."""
    first = board.report(local) if board is not None else local
    return first if first == local else f"{first} [then on {board.label}: {local}]"  # type: ignore[union-attr]


def failure_message(exc: BaseException, layout: Any, board: FailureBoard | None) -> str:
    """The one line a failed step raises: the first failure of the run, named by rank and stage.

    ``exc`` is what this rank caught: a :class:`RankFailure` (already explained), an exception
    of one of its own actions (the executor noted which), or anything else raised in the step.
    """
    if isinstance(exc, RankFailure):
        return str(exc)
    action = failed_action(exc)
    text = f"{type(exc).__name__}: {exc}"
    if action is not None:
        where = f"{layout.label(action.stage)} failed on micro-batch {action.microbatch}"
        return explain(board, f"{where}: {text}")
    return explain(board, f"{layout.label()} failed: {text}")


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
    """Waits for a collective or p2p request; a failure or timeout raises :class:`RankFailure`.

    Gloo wakes a waiting request as soon as a peer's connection closes, so a killed peer is
    noticed at once; a peer that is alive but silent is caught by the timeout.
    """
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
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
        first = board.read() or "no failure was reported on the failure board"
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
