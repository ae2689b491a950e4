"""The engine's failures: where a stage's exception was raised, and the engine's own errors.

A stage's exception reaches the caller as raised, with a note naming the stage, device and
micro-batch; :class:`PipelineError` is the engine's own (a timed-out wait, a lost rank):
docs/engine-internals.md#when-an-action-fails.

Example::

    >>> exc = ValueError("bad gradient")
    >>> note_failure(exc, Action("B", 1, 0), "cpu")
    >>> failed_action(exc)
    Action(kind='B', stage=1, microbatch=0)
    >>> exc.__notes__
    ['giantpipe: stage 1 (device cpu) failed on micro-batch 0 (backward)']
"""

from __future__ import annotations

from typing import Any

from giantpipe.engine.schedules.actions import Action

__all__ = ["Aborted", "PipelineError", "PipelineTimeout", "failed_action", "note_failure"]


class PipelineError(RuntimeError):
    """A failure of the pipeline engine itself, not of a stage's code: a timeout, a lost rank.

    An exception raised inside a stage is re-raised as it is (``except ValueError`` catches
    it), with a note naming the stage, device and micro-batch.
    """


class PipelineTimeout(PipelineError):
    """A worker waited longer than the timeout for an activation or gradient, or for a thread
    of a failed step to finish its action."""


class Aborted(Exception):
    """Raised in a waiting worker when another worker has failed (never reaches the caller)."""


_KINDS = {"F": "forward", "B": "backward", "W": "weight gradient"}


def failed_action(exc: BaseException) -> Action | None:
    """The action whose run raised ``exc`` (the note says the same to people), else None.

    Example::

        try:
            pipe.train_step(x, y, loss_fn)
        except ValueError as exc:
            failed_action(exc)   # Action(kind='B', stage=1, microbatch=0)
    """
    return getattr(exc, "_giantpipe_action", None)


def note_failure(exc: BaseException, action: Action, device: Any) -> None:
    """Adds to ``exc`` the note that names where it was raised (see :func:`failed_action`);
    the exception stays what the stage raised."""
    verb = "failed" if isinstance(exc, Exception) else "was stopped"  # Ctrl-C, SystemExit
    note = (
        f"giantpipe: stage {action.stage} (device {device}) {verb} on micro-batch "
        f"{action.microbatch} ({_KINDS.get(action.kind, action.kind)})"
    )
    # add_note is Python 3.11's (pyproject requires it): tracebacks print the note, on any
    # exception type, and the exception stays the one the stage raised.
    if note not in getattr(exc, "__notes__", ()):  # an exception object raised again
        exc.add_note(note)
    exc._giantpipe_action = action  # type: ignore[attr-defined]
