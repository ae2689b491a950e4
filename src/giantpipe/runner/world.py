"""Who runs the experiment: a world of one process (the local executor) or torchrun's processes.

The runner has one training loop for both executors; what differs is only how their processes
agree. :class:`World` is the local executor's world of one, where every collective is the
identity, and :class:`TorchrunWorld` the same calls over ``torch.distributed``; :class:`StopSignals`
catches the signals that stop or save a run, which the ranks then agree on. The calls, the
groups they run on, and agreed stopping: docs/architecture.md#how-the-processes-agree.

    >>> world = open_world(PipelineConfig())        # the local executor: World()
    >>> world.rank, world.size, world.from_rank0([4, 4]), world.sum([1.0, 2.0])
    (0, 1, [4, 4], [1.0, 2.0])
    >>> world.decide(lambda: "a plan")              # run on rank 0, its value everywhere
    'a plan'
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from giantpipe.config import ConfigError, PipelineConfig
from giantpipe.engine.distributed.faults import wait_work
from giantpipe.engine.distributed.layout import HOST_BACKEND, end_distributed, init_distributed

_T = TypeVar("_T")

SETUP_TIMEOUT_S = 1800.0
"""How long ranks wait for rank 0 during set-up (building the data, profiling a balance)."""


class World:
    """A world of one process: the local executor. Every collective is the identity."""

    rank = 0
    size = 1

    @property
    def writes(self) -> bool:
        """Whether this process writes the run directory (rank 0 only)."""
        return self.rank == 0

    def agree(self, body: Callable[[], _T]) -> _T:
        """Runs ``body`` on every rank; if it fails on any, every rank raises at once."""
        return body()

    def from_rank0(self, value: _T) -> _T:
        """Rank 0's ``value`` on every rank (a small picklable object)."""
        return value

    def decide(self, body: Callable[[], _T]) -> _T:
        """``body()`` run on rank 0 alone (a plan, a measured balance), its value on every rank;
        if it fails, every rank raises at once."""
        decided = self.agree(lambda: body() if self.rank == 0 else None)
        return cast(_T, self.from_rank0(decided))

    def gather(self, value: _T) -> list[_T]:
        """Every rank's ``value``, in rank order."""
        return [value]

    def collect(self, value: _T) -> list[_T] | None:
        """Every rank's ``value`` on rank 0, in rank order (None elsewhere)."""
        return [value]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums of ``values`` over the ranks (float64)."""
        return [float(v) for v in values]

    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def agree_stop(self, caught: Request) -> Request:
        """What any rank caught since the last step, on every rank (collective)."""
        return caught

    def bind(self, pipe: Any) -> None:
        """From now on collectives run on ``pipe``'s group and under its timeout."""

    def close(self) -> None:
        """Leaves the world (the process group, where there is one)."""


class TorchrunWorld(World):
    """torchrun's processes: one per pipeline rank, K ranks x R replicas (gloo or NCCL)."""

    def __init__(self, timeout: float) -> None:
        # A host group of the world carries set-up and the final summary; the steps run on the
        # pipe's own groups under pipeline.timeout. A rank that dies still wakes the others at
        # once. Not the world group itself: on CUDA it may serve only device tensors (NCCL).
        setup = datetime.timedelta(seconds=max(timeout, SETUP_TIMEOUT_S))
        init_distributed(timeout=setup.total_seconds())
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self._host: Any = dist.new_group(timeout=setup, backend=HOST_BACKEND)
        self._group: Any = self._host
        self._pipe: Any = None

    def agree(self, body: Callable[[], _T]) -> _T:
        try:
            result = body()
            error: BaseException | None = None
        except Exception as err:  # noqa: BLE001 - shared with the other ranks, then re-raised
            error = err
        texts: list[Any] = [None] * self.size
        dist.all_gather_object(texts, None if error is None else str(error), group=self._group)
        if error is not None:
            raise error
        failed = [(rank, text) for rank, text in enumerate(texts) if text is not None]
        if failed:
            rank, text = failed[0]
            raise RuntimeError(f"rank {rank} failed while setting up: {text}")
        return result

    def from_rank0(self, value: _T) -> _T:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def gather(self, value: _T) -> list[_T]:
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self._group)
        return values

    def collect(self, value: _T) -> list[_T] | None:
        values: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, values, dst=0, group=self._group)
        return values

    def sum(self, values: list[float]) -> list[float]:
        total = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(total, group=self._group, async_op=True)
        if self._pipe is None:
            work.wait()
        else:
            wait_work(work, self._pipe.timeout, "an all-reduce of the runner", self._pipe.board)
        return [float(v) for v in total.tolist()]

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def agree_stop(self, caught: Request) -> Request:
        flags = [float(caught.stop == kind) for kind in STOPS] + [float(caught.save)]
        *stops, save = self.sum(flags)
        kind = next((k for k, n in zip(STOPS, stops, strict=True) if n), None)
        return Request(kind, bool(save))

    def bind(self, pipe: Any) -> None:
        self._pipe, self._group = pipe, pipe.groups.control

    def close(self) -> None:
        pipe, self._pipe, self._group, self._host = self._pipe, None, None, None
        if pipe is not None:
            pipe.release()  # no request may outlive the groups (see DistributedPipe.release)
        end_distributed()  # and no group the interpreter's shutdown


def open_world(cfg: PipelineConfig) -> World:
    """The world ``pipeline.executor`` asks for, checked against how the process was started.

    Example::

        open_world(PipelineConfig())                        # World(): the local executor
        open_world(PipelineConfig(executor="distributed"))  # under torchrun: TorchrunWorld
    """
    if cfg.executor == "distributed":
        if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
            raise ConfigError(
                "pipeline.executor",
                "distributed needs one process per stage started by torchrun: torchrun "
                "--nproc_per_node=K train.py ... pipeline.executor=distributed",
            )
        return TorchrunWorld(cfg.timeout)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:
        raise ConfigError(
            "pipeline.executor",
            f"local runs in one process, but torchrun started {processes}; set "
            "pipeline.executor=distributed",
        )
    return World()


# -- signals -----------------------------------------------------------------------------------


STOPS = ("preempted", "hangup", "interrupted")
"""What a signal that stops a run is called (its summary status): SIGTERM, SIGHUP, Ctrl-C, in
the order that says which wins when the ranks (or one rank) caught several."""


@dataclass(frozen=True)
class Request:
    """What the signals caught ask for at the next step boundary."""

    stop: str | None = None
    """``preempted`` (SIGTERM), ``hangup`` (SIGHUP), ``interrupted`` (Ctrl-C) or None."""
    save: bool = False
    """``trainer.save_signal``: save a checkpoint and go on."""


class StopSignals:
    """Catches SIGTERM, SIGHUP, SIGINT and the save signal while installed (main thread only), so
    the loop can finish its step, save and stop (or save and go on); a second Ctrl-C stops at
    once. SIGHUP stops like SIGTERM (a dropped SSH session must not lose the steps since the last
    save), unless it is the save signal or the process ignores it (``nohup``: the run goes on).

    Example::

        with StopSignals("SIGUSR1") as signals:
            while training:
                step()
                request = world.agree_stop(signals.take())
    """

    def __init__(self, save_signal: str | None = None, on_term: Callable[[], None] | None = None):
        self.save_signal = getattr(signal, save_signal) if save_signal else None
        self.on_term = on_term
        """Called first on SIGTERM (e.g. to die at once when a peer rank already failed)."""
        self._stop: str | None = None
        self._save = False
        self._previous: dict[int, Any] = {}
        self._depth = 0
        """Nested ``with`` blocks: the handlers go back when the outermost one ends."""
        self._terminals: list[int] = []
        """stdout and stderr, where they are a terminal (known before it hangs up: after, the
        test itself fails)."""

    def __enter__(self) -> StopSignals:
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            wanted = {signal.SIGTERM, signal.SIGINT}
            if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # under nohup: keep going
                wanted.add(signal.SIGHUP)
            wanted |= {self.save_signal} if self.save_signal is not None else set()
            for signum in sorted(wanted):
                self._previous[signum] = signal.signal(signum, self._catch)
            self._terminals = [fd for fd in (1, 2) if os.isatty(fd)]
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        if signum == self.save_signal:
            self._save = True
        elif signum == signal.SIGTERM:
            if self.on_term is not None:
                self.on_term()
            self._stop = "preempted"
        elif signum == signal.SIGHUP:
            leave_lost_terminal(self._terminals)  # before the step's next output fails (EIO)
            self._stop = "preempted" if self._stop == "preempted" else "hangup"
        elif signum == signal.SIGINT:
            if self._stop == "interrupted":  # the second Ctrl-C: at once
                raise KeyboardInterrupt
            self._stop = self._stop or "interrupted"

    def take(self) -> Request:
        """What was caught since the last call (the stop stays: it is not undone)."""
        request, self._save = Request(self._stop, self._save), False
        return request


def leave_lost_terminal(terminals: Sequence[int]) -> None:
    """Points ``terminals`` (stdout and stderr where they were a terminal) at ``/dev/null``.

    After SIGHUP the terminal is gone, and a write to it fails (EIO): the progress bar, the log
    or the summary table would then fail the run after it saved. Output sent to a file or a pipe
    (``> log``, a cluster's log) is not a terminal and is left alone; the run's own record
    (``train.log``, ``metrics.jsonl``, ``summary.json``) is in its directory anyway.

    Example::

        leave_lost_terminal([fd for fd in (1, 2) if os.isatty(fd)])   # before the hang-up
    """
    if not terminals:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in terminals:
        os.dup2(null, fd)
    os.close(null)
