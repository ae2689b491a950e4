"""Worker threads that outlive a step: the local executor's pool, one thread per worker.

A fresh thread's first action is slow (cold allocator caches and torch's per-thread state: 103
against 68 ms for one AmoebaNet stage), so a :class:`~giantpipe.GPipe` keeps its workers::

    step 1:  start giantpipe-worker-0..K-1  -> run  -> idle (blocked on their queue)
    step 2:                                    run  -> idle
    failure:                                   run  -> all joined: a failed step leaves none
    pipe.close() or the pipe collected:                all joined

Threads are daemons, named ``giantpipe-worker-<i>``, and at most one per worker of the largest
schedule run. A thread holds nothing of a finished step: the task and its closure are dropped
before it waits again. Example::

    pool = WorkerPool()
    pool.run([lambda: print("a"), lambda: print("b")])  # both in parallel, returns when done
    pool.close()
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence

__all__ = ["WorkerPool"]

Task = Callable[[], None]


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
