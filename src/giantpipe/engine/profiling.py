"""The executor as ``torch.profiler`` sees it: a named range per action, and whether the running
profiler follows the calling thread only (torch.profiler's default: a step then runs its
workers' actions on that thread, so the trace holds every stage's ops; docs/profiling.md says
why).

Example::

    with torch.profiler.profile() as prof:
        pipe.train_step(x, y, loss_fn)      # ranges "giantpipe forward stage 1 mb 3", ...
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch

from giantpipe.engine.failures import PipelineError
from giantpipe.engine.mailbox import Mailbox
from giantpipe.engine.schedules.actions import Action

__all__ = ["arrived", "follows_this_thread_only", "interleave", "interleaves", "profiled"]

Lane = TypeVar("Lane")

_PROFILED = {"F": "forward", "B": "backward", "W": "weight"}


def profiled(action: Action) -> AbstractContextManager[Any]:
    """While a profiler runs, the action as a range of its own (``giantpipe forward stage 1
    mb 3``): the ops in a ``torch.profiler`` trace then say which stage and micro-batch ran them.

    Example::

        with profiled(Action("F", 1, 3)):
            stage(x)
    """
    # the flag of torch.profiler (any thread's); record_function costs a dispatch otherwise
    if not torch.autograd.profiler._is_profiler_enabled:  # noqa: SLF001
        return nullcontext()
    kind = _PROFILED.get(action.kind, action.kind)
    return torch.profiler.record_function(
        f"giantpipe {kind} stage {action.stage} mb {action.microbatch}"
    )


def follows_this_thread_only() -> bool:
    """Whether a profiler runs that records the calling thread and no other: torch.profiler's
    default (its state is the thread's own). One started with ``profile_all_threads=True`` is
    no thread's own, and records every thread.

    >>> follows_this_thread_only()
    False
    """
    return bool(torch.autograd._profiler_enabled())  # noqa: SLF001


def interleaves(needs_threads: bool) -> bool:
    """Whether a phase runs its workers' actions on the calling thread (:func:`interleave`): a
    profiler follows that thread only. A phase that needs its threads (the front door's
    backward on a GPU, which autograd calls on its device thread) keeps them, and says that
    the profiler misses them."""
    if not follows_this_thread_only():
        return False
    if needs_threads:
        warnings.warn(
            "giantpipe: torch.profiler records this thread only and this phase runs on worker "
            "threads; profile with experimental_config=torch.profiler._ExperimentalConfig("
            "profile_all_threads=True) to see their ops (docs/profiling.md)",
            stacklevel=4,
        )
    return not needs_threads


def arrived(action: Action, mailbox: Mailbox, last_with_loss: int | None) -> bool:
    """Whether what ``action`` consumes is in ``mailbox``: F the activation, B the gradient
    (the B of ``last_with_loss``, the last stage of a step with a loss, its own F's output);
    W its own B's graph.

    >>> box = Mailbox(timeout=1.0)
    >>> box.put(("act", 1, 0), "x")
    >>> [arrived(a, box, 1) for a in (Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0))]
    [True, False, True]
    """
    if action.kind == "W" or (action.kind == "B" and action.stage == last_with_loss):
        return True
    kind = "act" if action.kind == "F" else "grad"
    return mailbox.holds((kind, action.stage, action.microbatch))


def interleave(
    workers: Sequence[tuple[Sequence[Action], Lane]],
    ready: Callable[[Action], bool],
    act: Callable[[Action, Lane], None],
) -> None:
    """Every worker's actions on the calling thread, round after round: each worker takes its
    next action once ``ready`` says its input has arrived (any order the workers' threads
    could take computes the same); ``act(action, lane)`` runs it in its worker's context.

    >>> done = []
    >>> first, second = [Action("F", 0, 0), Action("F", 0, 1)], [Action("F", 1, 0)]
    >>> interleave([(first, 0), (second, 1)], lambda a: True, lambda a, lane: done.append(lane))
    >>> done
    [0, 1, 0]
    """
    queues = [(deque(actions), lane) for actions, lane in workers]
    while any(queue for queue, _ in queues):
        due = [(queue, lane) for queue, lane in queues if queue and ready(queue[0])]
        if not due:
            waiting = ", ".join(str(queue[0]) for queue, _ in queues if queue)
            raise PipelineError(f"no worker can go on: {waiting} each wait for another")
        for queue, lane in due:
            act(queue.popleft(), lane)
