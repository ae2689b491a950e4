"""Schedules by name: every schedule the pipes run, built from its name and validated.

A schedule is plain data, one ordered list of actions per worker; its parts:

- :mod:`.actions`: Action, Schedule, their dependencies and the validator (the legend);
- :mod:`.fill_drain`: GPipe's fill-drain (registry name ``"gpipe"``), its bubble and clock;
- :mod:`.one_f_one_b`: 1F1B, interleaved 1F1B, ZB-H1 and ZB-V.

This package's own code is the registry (:func:`build_schedule`, :data:`SCHEDULE_NAMES`); it
imports no torch, so the config reads it before torch loads.

Example::

    >>> build_schedule("1f1b", 2, 4).name
    '1f1b'
"""

from __future__ import annotations

from collections.abc import Callable

from giantpipe.engine.schedules import fill_drain, one_f_one_b
from giantpipe.engine.schedules.actions import Schedule, validate

ScheduleFn = Callable[[int, int, int], Schedule]
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
VIRTUAL_STAGES = {"interleaved": 2, "zb-v": 2}  # V unless given (1 for the others)


def schedule_builders() -> dict[str, ScheduleFn]:
    """Every schedule by name: ``fn(num_workers, chunks, virtual_stages)``."""
    return {
        "gpipe": fill_drain.fill_drain,
        "1f1b": one_f_one_b.one_f_one_b,
        "interleaved": one_f_one_b.interleaved,
        "zb-h1": one_f_one_b.zb_h1,
        "zb-v": one_f_one_b.zb_v,
    }


def build_schedule(name: str, num_workers: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    """Looks up a schedule by name and validates it.

    ``num_workers`` is K; with ``virtual_stages`` V the model is cut into K*V stages
    (``Schedule.num_stages``; 'gpipe' and 'interleaved' take V > 1, 'zb-v' needs V = 2).

    >>> build_schedule("gpipe", 2, 4).num_workers
    2
    >>> build_schedule("interleaved", 2, 4, virtual_stages=2).num_stages
    4
    """
    builders = schedule_builders()
    if name not in builders:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(builders)}")
    schedule = builders[name](num_workers, chunks, virtual_stages)
    validate(schedule)
    return schedule
