"""The one order of a step's transfers: every rank derives it from the schedule (NCCL's rule).

The step's schedule is simulated with unit costs and every message between two workers gets its
place in one global order, the time its producer ends (of two at once, the one needed sooner);
each rank issues its sends and receives in that order (:class:`~.p2p.P2PMailbox`). Why, and why
such an order always exists: docs/engine.md ("The transport").

Example::

    >>> from giantpipe.engine.schedules import build_schedule
    >>> s = build_schedule("1f1b", 2, 3)
    >>> [f"{m.key[0]}{m.key[2]}:{m.src}->{m.dst}" for m in message_order(s.actions, s.placement)]
    ['act0:0->1', 'act1:0->1', 'grad0:1->0', 'act2:0->1', 'grad1:1->0', 'grad2:1->0']
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from giantpipe.engine.mailbox import Key
from giantpipe.engine.schedules.actions import Action, dependencies

__all__ = ["Message", "Op", "message_order", "simulate_ends", "worker_ops"]


class Message(NamedTuple):
    """A boundary value that crosses from worker ``src`` to worker ``dst``."""

    key: Key  # the consumer's mailbox key: ("act", stage, m) or ("grad", stage, m)
    src: int
    dst: int


class Op(NamedTuple):
    """One device operation of a rank: send ``key`` to ``peer``, or receive it from ``peer``."""

    kind: str  # "send" | "recv"
    key: Key
    peer: int  # a worker of this rank's pipeline


def _costs(actions: Sequence[Sequence[Action]]) -> dict[Action, int]:
    split = {(a.stage, a.microbatch) for worker in actions for a in worker if a.kind == "W"}
    cost = {}
    for worker in actions:
        for a in worker:
            whole_b = a.kind == "B" and (a.stage, a.microbatch) not in split
            cost[a] = 2 if whole_b else 1
    return cost


def simulate_ends(actions: Sequence[Sequence[Action]], num_stages: int) -> dict[Action, int]:
    """When each action ends if every worker runs its list in order, each action starting as
    soon as its worker is free and its inputs are done (unit costs: F = 1, B = 2, or B = 1
    and W = 1 where the backward is split).

    >>> from giantpipe.engine.schedules import build_schedule
    >>> ends = simulate_ends(build_schedule("gpipe", 2, 2).actions, 2)
    >>> [ends[a] for a in build_schedule("gpipe", 2, 2).actions[1]]
    [2, 3, 5, 7]
    """
    cost = _costs(actions)
    ends: dict[Action, int] = {}
    cursors, free = [0] * len(actions), [0] * len(actions)
    remaining = sum(map(len, actions))
    while remaining:
        progressed = False
        for w, worker in enumerate(actions):
            while cursors[w] < len(worker):
                action = worker[cursors[w]]
                deps = dependencies(action, num_stages)
                if any(d not in ends for d in deps):
                    break
                start = max([free[w], *(ends[d] for d in deps)])
                ends[action] = free[w] = start + cost[action]
                cursors[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks; validate() it first")
    return ends


@functools.lru_cache(maxsize=64)
def message_order(
    actions: tuple[tuple[Action, ...], ...], placement: tuple[int, ...]
) -> tuple[Message, ...]:
    """Every message between two workers in one step of ``actions``, in the global order.

    Values between stages of one worker (interleaved schedules, ZB-V) stay in its mailbox and
    are not messages. Cached: a pipe runs the same schedule step after step.
    """
    ends = simulate_ends(actions, len(placement))
    cost = _costs(actions)
    last = len(placement) - 1
    timed: list[tuple[int, int, int, int, Message]] = []
    for action, end in ends.items():
        kind, stage, m = action
        if kind == "F" and stage < last:
            key, consumer = ("act", stage + 1, m), Action("F", stage + 1, m)
        elif kind == "B" and stage > 0:
            key, consumer = ("grad", stage - 1, m), Action("B", stage - 1, m)
        else:
            continue
        src, dst = placement[stage], placement[consumer.stage]
        if src != dst:
            needed = ends[consumer] - cost[consumer]
            timed.append((end, needed, stage, m, Message(key, src, dst)))
    # Ties: two producers ending at once are on two workers, and any fixed rule is a valid
    # order; the value needed first goes first. Each rank issues a receive only once the sends
    # before it are computed, and gloo moves a message at once only when its receive was issued
    # before the send: the other value of the tie has time to spare (docs/engine.md).
    timed.sort(key=lambda t: (t[0], t[1], t[2], t[3], t[4].key[0]))
    return tuple(message for *_, message in timed)


@functools.lru_cache(maxsize=64)
def worker_ops(
    actions: tuple[tuple[Action, ...], ...], placement: tuple[int, ...], worker: int
) -> tuple[Op, ...]:
    """The device operations of ``worker`` in the order it must issue them.

    >>> from giantpipe.engine.schedules import build_schedule
    >>> s = build_schedule("1f1b", 2, 2)
    >>> [f"{op.kind} {op.key[0]}{op.key[2]}" for op in worker_ops(s.actions, s.placement, 1)]
    ['recv act0', 'recv act1', 'send grad0', 'send grad1']
    """
    ops = []
    for message in message_order(actions, placement):
        if message.src == worker:
            ops.append(Op("send", message.key, message.dst))
        elif message.dst == worker:
            ops.append(Op("recv", message.key, message.src))
    return tuple(ops)
