"""The executor as ``torch.profiler`` sees it: a named range per action, and a warning when
the profiler would miss the worker threads.

Example (see docs/profiling.md)::

    with torch.profiler.profile(
        experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True)
    ) as prof:
        pipe.train_step(x, y, loss_fn)      # ranges "giantpipe forward stage 1 mb 3", ...
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from giantpipe.engine.schedules.actions import Action

__all__ = ["profiled", "warn_if_profiler_misses_workers"]

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


def warn_if_profiler_misses_workers() -> None:
    # torch.profiler's default collection follows only the thread that started it: the stages'
    # threads would be missing from its trace. profile_all_threads collects every thread (and
    # then no thread's own flag is set, so this stays quiet).
    if torch.autograd._profiler_enabled():  # noqa: SLF001
        warnings.warn(
            "giantpipe: torch.profiler records this thread only and the stages run on worker "
            "threads; profile with experimental_config=torch.profiler._ExperimentalConfig("
            "profile_all_threads=True) to see their ops (docs/profiling.md)",
            stacklevel=4,
        )
