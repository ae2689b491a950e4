"""Schedules as plain data: for each worker, the ordered list of actions it runs in one step.

F (forward), B (backward, or only the input gradient where a W follows) and W (weight gradient)
of micro-batch m on stage s; :func:`validate` checks a schedule, and the executor runs any it
accepts (legend and pictures: docs/engine-internals.md#schedules-as-data).

Example::

    >>> from giantpipe.engine.schedules.fill_drain import fill_drain
    >>> s = fill_drain(num_workers=2, chunks=2)
    >>> [str(a) for a in s.actions[0]]
    ['F0@0', 'F1@0', 'B1@0', 'B0@0']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Action(NamedTuple):
    """One unit of work: ``kind`` ('F', 'B' or 'W') of ``microbatch`` on ``stage``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """Per-worker action lists for one training step.

    ``actions[w]`` is worker ``w``'s list; ``placement[s]`` is the worker that owns stage ``s``
    (identity for GPipe and 1F1B, several stages per worker for interleaved schedules).
    """

    name: str
    num_stages: int  # K*V: the model's stages, over num_workers (K) workers
    chunks: int
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]

    @property
    def num_workers(self) -> int:
        return len(self.actions)

    @property
    def virtual_stages(self) -> int:
        """V, stages per worker (1 unless the schedule is interleaved)."""
        return self.num_stages // self.num_workers

    def is_fill_drain(self) -> bool:
        """True when every worker runs all its forwards before any backward.

        Only such schedules can back the autograd front door (``y = pipe(x);
        loss.backward()``), where the loss is computed outside the pipeline.
        """
        for worker in self.actions:
            kinds = [a.kind for a in worker]
            if "B" in kinds and "F" in kinds[kinds.index("B") :]:
                return False
        return True

    def phase(self, kinds: str) -> Schedule:
        """The same schedule keeping only actions whose kind is in ``kinds`` (e.g. ``"F"``)."""
        kept = tuple(tuple(a for a in w if a.kind in kinds) for w in self.actions)
        return Schedule(self.name, self.num_stages, self.chunks, kept, self.placement)


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """Actions that must finish before ``action`` may start.

    F(k, m) needs F(k-1, m)'s activation; B(k, m) needs its own F(k, m) and B(k+1, m)'s
    gradient (the last stage computes the loss inside F); W(k, m) needs B(k, m). Stages are
    global (0 .. K*V-1), so the same rules hold for virtual stages.
    """
    kind, stage, m = action
    if kind == "F":
        return [Action("F", stage - 1, m)] if stage > 0 else []
    if kind == "B":
        deps = [Action("F", stage, m)]
        if stage < num_stages - 1:
            deps.append(Action("B", stage + 1, m))
        return deps
    if kind == "W":
        return [Action("B", stage, m)]
    raise ValueError(f"unknown action kind {kind!r} in {action}")


def validate(schedule: Schedule) -> None:
    """Checks that a schedule is complete, runs each action once and cannot deadlock.

    Every (stage, micro-batch) needs one F and one B; a W is optional (it splits that B) and
    must follow its B. Every action runs on the worker its stage is placed on. Replays the
    schedule as the executor would: a worker may run its next action only when that action's
    dependencies are done. Raises ValueError naming the first problem found.
    """
    k, chunks = schedule.num_stages, schedule.chunks
    _check_placement(schedule)
    seen: list[Action] = [a for worker in schedule.actions for a in worker]
    if len(set(seen)) != len(seen):
        dup = next(a for a in seen if seen.count(a) > 1)
        raise ValueError(f"schedule {schedule.name!r} runs {dup} more than once")
    required = {Action(kind, s, mb) for kind in "FB" for s in range(k) for mb in range(chunks)}
    missing = required - set(seen)
    if missing:
        raise ValueError(f"schedule {schedule.name!r} never runs {sorted(missing)[0]}")
    for w, worker in enumerate(schedule.actions):
        for a in worker:
            if a.kind not in "FBW" or len(a.kind) != 1:
                raise ValueError(f"schedule {schedule.name!r} has unknown action kind in {a}")
            if not 0 <= a.stage < k or not 0 <= a.microbatch < chunks:
                raise ValueError(f"schedule {schedule.name!r} has out-of-range action {a}")
            if schedule.placement[a.stage] != w:
                raise ValueError(f"{a} is on worker {w} but stage {a.stage} is not placed there")
    _replay(schedule)


def _check_placement(schedule: Schedule) -> None:
    placement, workers = schedule.placement, schedule.num_workers
    if len(placement) != schedule.num_stages:
        raise ValueError(
            f"schedule {schedule.name!r} places {len(placement)} stages, "
            f"but has {schedule.num_stages}"
        )
    for stage, w in enumerate(placement):
        if not 0 <= w < workers:
            raise ValueError(f"stage {stage} is placed on worker {w}, but there are {workers}")


def _replay(schedule: Schedule) -> None:
    done: set[Action] = set()
    cursors = [0] * schedule.num_workers
    remaining = sum(len(w) for w in schedule.actions)
    while remaining:
        progressed = False
        for w, worker in enumerate(schedule.actions):
            while cursors[w] < len(worker):
                action = worker[cursors[w]]
                if not all(d in done for d in dependencies(action, schedule.num_stages)):
                    break
                done.add(action)
                cursors[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(w[c]) for w, c in zip(schedule.actions, cursors) if c < len(w)]
            raise ValueError(f"schedule {schedule.name!r} deadlocks; waiting: {', '.join(stuck)}")


def in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once.

    A micro-batch is held from its F until its B, or until its W where the schedule splits
    the backward (the graph is kept for the weight gradient).

    >>> from giantpipe.engine.schedules.fill_drain import fill_drain
    >>> in_flight(fill_drain(2, 4))
    [4, 4]
    """
    held, peak = [0] * schedule.num_stages, [0] * schedule.num_stages
    split = {(a.stage, a.microbatch) for w in schedule.actions for a in w if a.kind == "W"}
    for worker in schedule.actions:
        for a in worker:
            if a.kind == "F":
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split):
                held[a.stage] -= 1
    return peak


def _check_sizes(num_workers: int, chunks: int, virtual_stages: int = 1) -> None:
    if num_workers < 1:
        raise ValueError(f"number of workers must be positive (got {num_workers})")
    if chunks < 1:
        raise ValueError(f"number of chunks must be positive integer (chunks: {chunks})")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be positive (got {virtual_stages})")


def format_schedule(schedule: Schedule) -> str:
    """Renders per-worker action lists as text, one line per worker (for logs and docs)."""
    return "\n".join(
        f"worker {w} | " + " ".join(str(a) for a in actions)
        for w, actions in enumerate(schedule.actions)
    )
