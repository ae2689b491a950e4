"""The executor's workers: long-lived threads that run a step's tasks, step after step.

A :class:`WorkerPool` keeps its threads between steps (a fresh thread's first action is slow),
retires those of a failed step and joins them before the next, and at interpreter exit stops
every thread still alive: docs/engine-internals.md#worker-threads.

Example::

    >>> from giantpipe.engine.mailbox import Mailbox
    >>> box = Mailbox(timeout=1.0)
    >>> pool = WorkerPool()
    >>> pool.run([lambda: box.put(("act", 1, 0), "x"), lambda: print(box.get(("act", 1, 0)))])
    x
    >>> pool.close()
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TypeAlias

from giantpipe.engine.failures import PipelineTimeout
from giantpipe.engine.spec import DEFAULT_TIMEOUT

__all__ = ["WorkerPool"]

Task = Callable[[], None]
Inbox: TypeAlias = "queue.SimpleQueue[Task | None]"
Worker = tuple[threading.Thread, Inbox]

_alive: dict[threading.Thread, tuple[Inbox, float]] = {}
"""Every worker thread not yet ended, any pool's: its inbox and its join timeout at exit."""
_alive_lock = threading.Lock()


class WorkerPool:
    """Runs each of a list of tasks on its own long-lived thread
    (docs/engine-internals.md#worker-threads)."""

    def __init__(self) -> None:
        # The threads see only this list (never the pool), so dropping the pool stops them.
        self._workers: list[Worker] = []
        self._retired: list[threading.Thread] = []  # of a failed run, maybe still in a task
        self._timeout = DEFAULT_TIMEOUT  # the last run's, for close()
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        self._finalizer.atexit = False  # at exit, _join_at_exit stops every pool's threads

    def run(self, tasks: Sequence[Task], timeout: float = DEFAULT_TIMEOUT) -> None:
        """Runs ``tasks[i]`` on thread i, all at once; returns when every task has returned.

        The first task to raise (or an interrupt of the caller) ends the run at once: that
        exception is raised here while the other tasks may still be running; the run's threads
        are retired. A run first joins the threads an earlier failed run retired, for at most
        ``timeout`` seconds (then PipelineTimeout names them, and they are left to end alone).

        Example::

            pool.run([stage_0_actions, stage_1_actions], timeout=60.0)
        """
        with self._lock:  # one run at a time: a pipe's steps do not overlap
            self._timeout = timeout
            self._join_retired(timeout)
            self._grow(len(tasks))
            with _alive_lock:  # a failed run's threads get this long to end at exit
                for thread, inbox in self._workers:
                    _alive[thread] = (inbox, timeout)
            done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
            for (_, inbox), task in zip(self._workers, tasks):
                inbox.put(_reporting(task, done))
            try:
                for _ in tasks:
                    failure = done.get()
                    if failure is not None:
                        try:
                            raise failure
                        finally:
                            failure = None  # no cycle through this frame: frees the step
            except BaseException:
                self._retire()
                raise

    def close(self) -> None:
        """Stops and joins every thread (those of a failed run for at most the last run's
        timeout); a later :meth:`run` starts fresh ones."""
        with self._lock:
            _stop(self._workers)
            try:
                self._join_retired(self._timeout)
            except PipelineTimeout:
                pass  # stuck in a failed step's action: a daemon, left to end by itself

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
            with _alive_lock:
                _alive[thread] = (inbox, self._timeout)
            thread.start()
            self._workers.append((thread, inbox))

    def _retire(self) -> None:
        # Each thread ends once its current task returns (the executor's tasks stop at their
        # next action); joined by the next run, so none overlaps it.
        for thread, inbox in self._workers:
            inbox.put(None)
            self._retired.append(thread)
        self._workers.clear()

    def _join_retired(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._retired:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._retired if t.is_alive()]
        self._retired.clear()
        if stuck:
            raise PipelineTimeout(
                f"{', '.join(stuck)} still ran an action of a failed step after {timeout:g}s; "
                "it is left to end by itself (a daemon) and the next step starts fresh threads"
            )


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
    try:
        while (task := inbox.get()) is not None:
            task()
            del task  # don't keep the finished step (its activations) alive while idle
    finally:
        with _alive_lock:
            _alive.pop(threading.current_thread(), None)


def _stop(workers: list[Worker]) -> None:
    for _, inbox in workers:
        inbox.put(None)
    for thread, _ in workers:
        if thread is not threading.current_thread():
            thread.join()
    workers.clear()


@atexit.register
def _join_at_exit() -> None:
    """Stops every worker thread still alive and joins it: an idle one at once, one still in
    an action of a failed step once that action ends (at most its run's timeout, as
    :meth:`WorkerPool.close` waits; a thread stuck longer is left as it is)."""
    with _alive_lock:
        alive = list(_alive.items())
    start = time.monotonic()
    for _, (inbox, _) in alive:
        inbox.put(None)  # a thread ends at its first None; one more is harmless
    for thread, (_, timeout) in alive:
        if thread is not threading.current_thread():
            thread.join(max(0.0, start + timeout - time.monotonic()))


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads (and the lock may have been held)."""
    global _alive_lock
    _alive.clear()
    _alive_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
