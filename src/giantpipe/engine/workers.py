"""The local executor's workers: long-lived threads, and the mailbox through which they hand
each other activations and gradients.

**Threads.** A fresh thread's first action is slow (cold allocator caches and torch's
per-thread state: 103 against 68 ms for one AmoebaNet stage), so a :class:`~giantpipe.GPipe`
keeps its workers in a :class:`WorkerPool`::

    step 1:  start giantpipe-worker-0..K-1  -> run  -> idle (blocked on their queue)
    step 2:                                    run  -> idle
    failure:                                   run  -> all joined: a failed step leaves none
    pipe.close() or the pipe collected:                all joined

Threads are daemons, named ``giantpipe-worker-<i>``, and at most one per worker of the largest
schedule run. A thread holds nothing of a finished step: the task and its closure are dropped
before it waits again.

**Mailbox.** Keys are ``("act", stage, m)`` (input of ``stage`` for micro-batch ``m``) and
``("grad", stage, m)`` (gradient of ``stage``'s output). A ``get`` blocks until the item
arrives, the pipeline is aborted (another worker failed), or the timeout passes; nothing waits
forever. The distributed executor's mailbox (:mod:`giantpipe.engine.dist.p2p`) keeps this
interface and reaches other processes.

Example::

    >>> box = Mailbox(timeout=1.0)
    >>> pool = WorkerPool()
    >>> pool.run([lambda: box.put(("act", 1, 0), "x"), lambda: print(box.get(("act", 1, 0)))])
    x
    >>> pool.close()
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Aborted", "Key", "Mailbox", "PipelineTimeout", "WorkerPool"]

Key = tuple[str, int, int]
Task = Callable[[], None]

# ---- the mailbox --------------------------------------------------------------------------


class Aborted(Exception):
    """Raised in a waiting worker when another worker has failed."""


class PipelineTimeout(RuntimeError):
    """A worker waited longer than the timeout for an activation or gradient."""


class Mailbox:
    """Thread-safe hand-over of values between workers, with abort and timeout."""

    def __init__(self, timeout: float) -> None:
        self._items: dict[Key, Any] = {}
        self._cond = threading.Condition()
        self._aborted = False
        self.timeout = timeout

    def put(self, key: Key, value: Any) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def get(self, key: Key) -> Any:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while key not in self._items:
                if self._aborted:
                    raise Aborted
                left = deadline - time.monotonic()
                if left <= 0:
                    kind, stage, m = key
                    what = "activation" if kind == "act" else "gradient"
                    raise PipelineTimeout(
                        f"waited {self.timeout:.0f}s for the {what} of micro-batch {m} "
                        f"into stage {stage}"
                    )
                self._cond.wait(left)
            return self._items.pop(key)

    def abort(self) -> None:
        """Wakes every waiting worker with :class:`Aborted`."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    @property
    def aborted(self) -> bool:
        return self._aborted


# ---- the worker threads -------------------------------------------------------------------
class WorkerPool:
    """Runs each of a list of tasks on its own long-lived thread; see the module docstring."""

    def __init__(self) -> None:
        # The threads see only this list (never the pool), so dropping the pool stops them.
        self._workers: list[tuple[threading.Thread, queue.SimpleQueue[Task | None]]] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        self._finalizer.atexit = False  # daemons die with the interpreter; never wait on one

    def run(self, tasks: Sequence[Task]) -> None:
        """Runs ``tasks[i]`` on thread i, all at once; returns when every task has returned.

        Tasks must not raise (the executor's catch everything and report through the mailbox);
        one that does is re-raised here after the others finished, and the pool is closed.
        """
        with self._lock:  # one run at a time: a pipe's steps do not overlap
            self._grow(len(tasks))
            done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
            for (_, inbox), task in zip(self._workers, tasks):
                inbox.put(_reporting(task, done))
            failures = [e for e in (done.get() for _ in tasks) if e is not None]
        if failures:
            self.close()
            raise failures[0]

    def close(self) -> None:
        """Stops and joins every thread; a later :meth:`run` starts fresh ones."""
        with self._lock:
            _stop(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def __reduce__(self) -> tuple[type[WorkerPool], tuple[()]]:
        # Copies (deepcopy, pickle) of a pipe get an empty pool of their own.
        return (WorkerPool, ())

    def _grow(self, n: int) -> None:
        while len(self._workers) < n:
            inbox: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
            name = f"giantpipe-worker-{len(self._workers)}"
            thread = threading.Thread(target=_serve, args=(inbox,), daemon=True, name=name)
            thread.start()
            self._workers.append((thread, inbox))


def _reporting(task: Task, done: queue.SimpleQueue[BaseException | None]) -> Task:
    def report() -> None:
        try:
            task()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.put(exc)
        else:
            done.put(None)

    return report


def _serve(inbox: queue.SimpleQueue[Task | None]) -> None:
    while (task := inbox.get()) is not None:
        task()
        del task  # don't keep the finished step (its activations) alive while idle


def _stop(workers: list[tuple[threading.Thread, queue.SimpleQueue[Task | None]]]) -> None:
    for _, inbox in workers:
        inbox.put(None)
    for thread, _ in workers:
        if thread is not threading.current_thread():
            thread.join()
    workers.clear()
