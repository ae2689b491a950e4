"""The one order of a step's transfers (engine/distributed/message_order.py): each worker's
share holds exactly the values its actions take from and give to other workers, both ends of
every pair list that pair's values alike, and every worker can issue its share in turn."""

from __future__ import annotations

import pytest

from giantpipe.engine.distributed.message_order import Op, message_order, worker_ops
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


def test_the_order_is_cached_for_the_steps_of_a_pipe() -> None:
    plan = build_schedule("1f1b", 2, 3)
    actions = tuple(map(tuple, plan.actions))
    worker_ops(actions, plan.placement, 1)
    hits = worker_ops.cache_info().hits
    worker_ops(actions, plan.placement, 1)
    assert worker_ops.cache_info().hits == hits + 1
