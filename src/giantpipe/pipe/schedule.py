"""Schedules as plain data: for each worker, the ordered list of actions it runs in one step.

Legend (the paper's letters)::

    K  stages (partitions), one worker each       M  micro-batches per mini-batch
    F  forward of micro-batch m on stage k         B  backward of m on stage k
    W  weight-gradient of m on stage k (reserved for zero-bubble schedules)

GPipe's fill-drain for K=3, M=4 (time flows right; each column is one clock tick)::

    stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
    stage 1 | .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
    stage 2 | .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .  .

The executor runs any schedule that :func:`validate` accepts: an action waits only for the data
it needs (the activation from the previous stage, the gradient from the next), so 1F1B,
interleaved or zero-bubble orders are other lists, not other executors.

Example::

    >>> s = gpipe(num_stages=2, num_microbatches=2)
    >>> [str(a) for a in s.actions[0]]
    ['F0@0', 'F1@0', 'B1@0', 'B0@0']
"""

from __future__ import annotations

from collections.abc import Callable
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
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]

    @property
    def num_workers(self) -> int:
        return len(self.actions)

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
        return Schedule(self.name, self.num_stages, self.num_microbatches, kept, self.placement)


def expected_bubble(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a fill-drain pipeline with equal stage costs: (K-1)/(M+K-1).

    >>> expected_bubble(4, 4)
    0.42857142857142855
    """
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe fill-drain: all forwards in micro-batch order, then all backwards in reverse.

    Backwards run last-in first-out, as autograd would for the whole mini-batch, so the last
    micro-batch (whose activations are the freshest) is released first.
    """
    _check_sizes(num_stages, num_microbatches)
    workers = []
    for stage in range(num_stages):
        forwards = [Action("F", stage, m) for m in range(num_microbatches)]
        backwards = [Action("B", stage, m) for m in reversed(range(num_microbatches))]
        workers.append(tuple(forwards + backwards))
    return Schedule("gpipe", num_stages, num_microbatches, tuple(workers), tuple(range(num_stages)))


def clock_cycles(num_stages: int, num_microbatches: int) -> list[list[tuple[int, int]]]:
    """Forward clock ticks of fill-drain: at tick t, stage k runs micro-batch t - k.

    >>> clock_cycles(2, 3)
    [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]

    Each pair is (micro-batch, stage); useful to draw or reason about the pipeline's fill.
    """
    _check_sizes(num_stages, num_microbatches)
    ticks = []
    for t in range(num_microbatches + num_stages - 1):
        ticks.append([(t - k, k) for k in range(num_stages) if 0 <= t - k < num_microbatches])
    return ticks


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe}


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Looks up a schedule by name and validates it.

    >>> build_schedule("gpipe", 2, 4).num_workers
    2
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    schedule = SCHEDULES[name](num_stages, num_microbatches)
    validate(schedule)
    return schedule


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """Actions that must finish before ``action`` may start.

    F(k, m) needs F(k-1, m)'s activation; B(k, m) needs its own F(k, m) and B(k+1, m)'s
    gradient (the last stage computes the loss inside F); W(k, m) needs B(k, m).
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

    Replays the schedule as the executor would: a worker may run its next action only when that
    action's dependencies are done. Raises ValueError naming the first problem found.
    """
    k, m = schedule.num_stages, schedule.num_microbatches
    seen: list[Action] = [a for worker in schedule.actions for a in worker]
    if len(set(seen)) != len(seen):
        dup = next(a for a in seen if seen.count(a) > 1)
        raise ValueError(f"schedule {schedule.name!r} runs {dup} more than once")
    required = {Action(kind, s, mb) for kind in "FB" for s in range(k) for mb in range(m)}
    missing = required - set(seen)
    if missing:
        raise ValueError(f"schedule {schedule.name!r} never runs {sorted(missing)[0]}")
    for w, worker in enumerate(schedule.actions):
        for a in worker:
            if not 0 <= a.stage < k or not 0 <= a.microbatch < m:
                raise ValueError(f"schedule {schedule.name!r} has out-of-range action {a}")
            if schedule.placement[a.stage] != w:
                raise ValueError(f"{a} is on worker {w} but stage {a.stage} is not placed there")
    _replay(schedule)


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


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"number of stages must be positive (got {num_stages})")
    if num_microbatches < 1:
        raise ValueError(f"number of chunks must be positive integer (chunks: {num_microbatches})")


def format_schedule(schedule: Schedule) -> str:
    """Renders per-worker action lists as text, one line per worker (for logs and docs)."""
    return "\n".join(
        f"worker {w} | " + " ".join(str(a) for a in actions)
        for w, actions in enumerate(schedule.actions)
    )
