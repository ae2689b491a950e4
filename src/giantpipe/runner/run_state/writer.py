"""The background writer: :class:`CheckpointWriter` saves in the step or, with
``trainer.async_save``, copies the state to host memory in the step and writes and commits it
in a thread of its own; a failure there comes back as :class:`BackgroundSaveError`.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor

from giantpipe.engine.distributed.layout import HOST_BACKEND
from giantpipe.runner.run_state.staging import Staged, host_group, stage, write_staged
from giantpipe.runner.run_state.state import Progress

if TYPE_CHECKING:
    from giantpipe.runner.build import Experiment
    from giantpipe.runner.world import World


class BackgroundSaveError(RuntimeError):
    """A checkpoint written in the background failed; ``cause`` says why (reported at the next
    save or at the end of the run, never lost)."""

    def __init__(self, directory: Path, step: int, cause: BaseException) -> None:
        super().__init__(
            f"the checkpoint of step {step} could not be written to {directory} "
            f"({type(cause).__name__}: {cause})"
        )
        self.directory, self.step, self.cause = directory, step, cause


class CheckpointWriter:
    """Saves a run's checkpoints, in the step or (``asynchronous``) in a background thread.

    Asynchronous: the step waits only for the copy of the state to host memory (buffers kept
    for the run: one more copy of the state in host memory); a thread writes the files and
    commits them, while training goes on. Our own thread rather than
    ``dcp.async_save``: the commit (hashing every file, then the manifest) must follow the
    write in the background too, and one code path then serves both modes. Saves of the same
    step (``step_N/`` then ``last/``) share one copy of the tensors and queue behind it; a
    save of another step, and :meth:`wait`, wait for the previous ones and raise their
    failure (BackgroundSaveError).
    Under torchrun the thread's collectives run on a gloo group of their own, so they never
    mix with the step's.

    Example::

        writer = CheckpointWriter(world, asynchronous=True, on_commit=print)
        writer.save(parts, progress, run_dir / "last")     # returns after the copy
        writer.wait()                                      # the write is committed
    """

    def __init__(
        self,
        world: World,
        asynchronous: bool = False,
        on_commit: Callable[[Path, int], None] | None = None,
    ) -> None:
        self.world, self.asynchronous = world, asynchronous
        self.on_commit = on_commit or (lambda directory, step: None)
        self._job: _Job | None = None
        self._group: Any = None
        self._buffers: dict[str, Tensor] = {}
        """Host copies of the tensors, reused by every asynchronous save of the run."""

    def save(
        self,
        parts: Experiment,
        progress: Progress,
        directory: Path,
        about: dict[str, Any] | None = None,
    ) -> None:
        """Saves ``parts`` at ``progress`` into ``directory`` (collective)."""
        job, about = self._job, about or {}
        if job is not None and job.step == progress.step:  # the same tensors: the same copy
            job.add(directory, stage(parts, progress, self.world, about, copied=job.tensors))
            return
        self.wait()
        buffers = self._buffers if self.asynchronous else None
        staged = stage(parts, progress, self.world, about, buffers)
        if not self.asynchronous:
            write_staged(staged, directory, host_group(parts.pipe, self.world))
            self.on_commit(directory, progress.step)
            return
        self._job = _Job(staged, self._background_group(parts.pipe), self.on_commit)
        self._job.add(directory, staged)
        self._job.start()

    def wait(self) -> None:
        """Returns once the save in flight (if any) is committed; raises its failure."""
        job, self._job = self._job, None
        if job is None:
            return
        job.close()
        job.join()
        if job.failure is not None:
            failed, step = job.failed_at or Path("?"), job.step
            if isinstance(job.failure, KeyboardInterrupt):
                raise job.failure
            raise BackgroundSaveError(failed, step, job.failure) from job.failure

    def _background_group(self, pipe: Any) -> Any:
        if self.world.size == 1:
            return None
        if self._group is None:  # every rank reaches its first save at the same step
            timeout = datetime.timedelta(seconds=float(pipe.timeout))
            self._group = dist.new_group(backend=HOST_BACKEND, timeout=timeout)
        return self._group


class _Job(threading.Thread):
    """Writes the saves of one step handed to it, in order, until closed."""

    def __init__(self, staged: Staged, group: Any, on_commit: Callable[[Path, int], None]):
        super().__init__(name="giantpipe-checkpoint", daemon=True)  # Ctrl-C twice: stop at once
        self.step, self.tensors = staged.step, staged.tensors
        self.group, self.on_commit = group, on_commit
        self.failure: BaseException | None = None
        self.failed_at: Path | None = None
        self._todo: list[tuple[Path, Staged]] = []
        self._closed = False
        self._ready = threading.Condition()

    def add(self, directory: Path, staged: Staged) -> None:
        with self._ready:
            self._todo.append((directory, staged))
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()

    def run(self) -> None:
        while True:
            with self._ready:
                while not self._todo and not self._closed:
                    self._ready.wait()
                if not self._todo:
                    return
                directory, staged = self._todo.pop(0)
            if self.failure is not None:
                continue  # every rank failed the same save together: all skip the rest
            try:
                write_staged(staged, directory, self.group)
                self.on_commit(directory, self.step)
            except BaseException as err:  # noqa: BLE001 - reported by CheckpointWriter.wait
                self.failure, self.failed_at = err, directory
