"""The one order of a step's transfers (engine/distributed/message_order.py): each worker's
share holds exactly the values its actions take from and give to other workers, both ends of
every pair list that pair's values alike, and every worker can issue its share in turn."""

from __future__ import annotations

import pytest

from giantpipe.engine.distributed.message_order import (
    Op,
    message_order,
    simulate_ends,
    worker_ops,
)
from giantpipe.engine.schedules import build_schedule, schedule_builders
from giantpipe.engine.schedules.actions import Action


def crossing(actions: tuple[Action, ...], placement: tuple[int, ...], worker: int) -> list[Op]:
    """What ``worker``'s actions take from and give to other workers, in the order they run."""
    last = len(placement) - 1
    ops = []
    for kind, stage, m in actions:
        if kind == "F" and stage > 0 and placement[stage - 1] != worker:
            ops.append(Op("recv", ("act", stage, m), placement[stage - 1]))
        if kind == "B" and stage < last and placement[stage + 1] != worker:
            ops.append(Op("recv", ("grad", stage, m), placement[stage + 1]))
        if kind == "F" and stage < last and placement[stage + 1] != worker:
            ops.append(Op("send", ("act", stage + 1, m), placement[stage + 1]))
        if kind == "B" and stage > 0 and placement[stage - 1] != worker:
            ops.append(Op("send", ("grad", stage - 1, m), placement[stage - 1]))
    return ops


@pytest.mark.parametrize("name", sorted(schedule_builders()))
@pytest.mark.parametrize(("workers", "chunks"), [(2, 4), (3, 6), (4, 8)])
def test_each_share_is_what_the_workers_actions_exchange_agreed_by_both_ends(
    name: str, workers: int, chunks: int
) -> None:
    v = 2 if name in ("interleaved", "zb-v") else 1
    plan = build_schedule(name, workers, chunks, v)
    actions = tuple(map(tuple, plan.actions))
    shares = {w: worker_ops(actions, plan.placement, w) for w in range(workers)}
    for w, share in shares.items():
        assert sorted(share) == sorted(crossing(actions[w], plan.placement, w)), (name, w)
        # a send is issued in the order this worker computes it
        sends = [op for op in share if op.kind == "send"]
        assert sends == [op for op in crossing(actions[w], plan.placement, w) if op.kind == "send"]
        for peer in range(workers):
            mine = [op.key for op in share if op.peer == peer]
            theirs = [op.key for op in shares[peer] if op.peer == w]
            assert mine == theirs, (name, w, peer)  # one order per pair, at both ends
    assert len(message_order(actions, plan.placement)) == sum(
        op.kind == "send" for share in shares.values() for op in share
    )


def test_zb_v_interleaves_a_pairs_values_in_the_order_they_are_made() -> None:
    """ZB-V: rank 0 holds stages 0 and 3, so it gets stage 1's activations and stage 2's
    gradients from rank 1, in the order rank 1 makes them."""
    plan = build_schedule("zb-v", 2, 2, 2)
    actions = tuple(map(tuple, plan.actions))
    got = [op.key for op in worker_ops(actions, plan.placement, 0) if op.kind == "recv"]
    made = [
        ("act", 3, a.microbatch) if a.kind == "F" else ("grad", 0, a.microbatch)
        for a in plan.actions[1]
        if (a.kind, a.stage) in {("F", 2), ("B", 1)}
    ]
    assert got == made


def named(op: Op) -> str:
    kind, stage, m = op.key
    return f"{op.kind} {kind}{stage}.{m}"


def test_zb_v_places_a_value_needed_at_once_before_a_value_made_at_the_same_time() -> None:
    """K=2, M=4: where the unit-cost simulation ends a send of rank 0 and one of rank 1 at once
    (F2@0 and F0@2 at t=3, B0@3 and F1@2 at t=5, F3@0 and B1@1 at t=11), the value whose
    consumer starts at once goes first, the one with time to spare after it."""
    plan = build_schedule("zb-v", 2, 4, 2)
    actions = tuple(map(tuple, plan.actions))
    shares = {w: list(map(named, worker_ops(actions, plan.placement, w))) for w in (0, 1)}
    assert shares[0] == [
        "send act1.0", "send act1.1", "recv act3.0", "send act1.2", "send grad2.0",
        "recv act3.1", "recv grad0.0", "send grad2.1", "recv grad0.1", "send act1.3",
        "recv act3.2", "send grad2.2", "recv grad0.2", "recv act3.3", "send grad2.3",
        "recv grad0.3",
    ]  # fmt: skip
    swap = {"send": "recv", "recv": "send"}
    assert shares[1] == [f"{swap[op.split()[0]]} {op.split()[1]}" for op in shares[0]]


def held_receives(name: str, workers: int, chunks: int) -> list[tuple[int, str]]:
    """Receives (worker, key) that, in the unit-cost simulation, a worker can issue only once a
    send before it in its share is computed, at the very moment the peer sends the value and
    its consumer needs it: gloo then moves the bytes only after a round trip through the
    sender's I/O thread, on the step's critical path."""
    plan = build_schedule(name, workers, chunks, 2 if name in ("interleaved", "zb-v") else 1)
    actions = tuple(map(tuple, plan.actions))
    ends = simulate_ends(actions, plan.num_stages)
    last = plan.num_stages - 1
    split = {(a.stage, a.microbatch) for worker in actions for a in worker if a.kind == "W"}
    made, needed = {}, {}
    for a in (a for worker in actions for a in worker):
        if a.kind == "F" and a.stage < last:
            made[("act", a.stage + 1, a.microbatch)] = ends[a]
        if a.kind == "B" and a.stage > 0:
            made[("grad", a.stage - 1, a.microbatch)] = ends[a]
        if a.kind in "FB":  # when it starts: F costs 1, B 2 (1 where a W follows)
            whole = a.kind == "B" and (a.stage, a.microbatch) not in split
            kind = "act" if a.kind == "F" else "grad"
            needed[(kind, a.stage, a.microbatch)] = ends[a] - 1 - whole
    held = []
    for w in range(workers):
        gate = 0  # when the sends before this point of the share are all computed
        for op in worker_ops(actions, plan.placement, w):
            if op.kind == "send":
                gate = max(gate, made[op.key])
            elif gate >= made[op.key] and needed[op.key] <= gate:
                held.append((w, named(op).split()[1]))
    return held


@pytest.mark.parametrize("chunks", [4, 8])
def test_zb_v_on_two_workers_holds_no_receive_needed_at_once(chunks: int) -> None:
    assert held_receives("zb-v", 2, chunks) == []


def test_a_receive_is_held_where_both_values_of_a_tie_are_needed_at_once() -> None:
    """1F1B: F2@0 and B1@1 end at once and each is taken at once: whichever goes first, the
    other end's receive waits for its own send (no order can help it)."""
    assert held_receives("1f1b", 2, 4) == [(0, "grad0.1"), (0, "grad0.2")]


def test_the_order_is_cached_for_the_steps_of_a_pipe() -> None:
    plan = build_schedule("1f1b", 2, 3)
    actions = tuple(map(tuple, plan.actions))
    worker_ops(actions, plan.placement, 1)
    hits = worker_ops.cache_info().hits
    worker_ops(actions, plan.placement, 1)
    assert worker_ops.cache_info().hits == hits + 1
