"""Every NCCL communicator is made when the pipe is built, in one order all ranks agree on
(issue 32, item 6).

NCCL makes a group's communicator at its first operation and a pair's at its first send, each a
collective of its members; made lazily inside step 1, while other pairs' kernels already wait
on the GPU, creations can deadlock. ``layout.warm_up`` runs one operation on every device group
and every pair of pipeline ranks that exchange values, before step 1, in the order
``layout.warm_up_order`` derives, which is the same on every rank. The order is replayed here
under NCCL's rule (``tests/distributed/nccl_rules.py``, every group its own communicator); the
real run on gloo is ``tests/unit/engine/distributed/test_k2_r2.py`` (its recorded calls) and
``tests/distributed/test_nccl_order.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from giantpipe.engine.distributed import layout as layout_module
from giantpipe.engine.distributed.layout import Groups, Layout, WarmUp, tied_workers, warm_up_order
from giantpipe.engine.distributed.message_order import message_order
from giantpipe.engine.schedules import build_schedule
from tests.distributed.nccl_rules import Deadlock, DeviceOp, replay

SHAPES = [  # workers, replicas, schedule, V, tied workers
    (2, 1, "gpipe", 1, []),
    (2, 2, "1f1b", 1, [(0, 1)]),
    (3, 2, "interleaved", 2, [(0, 2)]),
    (4, 1, "zb-h1", 1, [(0, 3), (1, 2)]),
    (2, 4, "zb-v", 2, []),
    (4, 2, "interleaved", 2, [(0, 3)]),
]


def device_ops(order: list[WarmUp], rank: int) -> list[DeviceOp]:
    """One rank's share of ``order`` as the replay takes it: a collective on its own group
    (communicator), or the pair's message on the world's p2p group."""
    ops = []
    for op in order:
        if rank not in op.ranks:
            continue
        if op.group == "pair":
            kind = "send" if rank == op.ranks[0] else "recv"
            peer = op.ranks[1] if kind == "send" else op.ranks[0]
            ops.append(DeviceOp(kind, peer, nbytes=4, comm="p2p"))
        else:
            comm = f"{op.group}{list(op.ranks)}"
            ops.append(DeviceOp("collective", group=op.ranks, nbytes=4, comm=comm))
    return ops


@pytest.mark.parametrize(("workers", "replicas", "name", "v", "tied"), SHAPES)
def test_every_rank_derives_one_order_and_it_replays_under_nccls_rule(
    workers: int, replicas: int, name: str, v: int, tied: list[tuple[int, ...]]
) -> None:
    plan = build_schedule(name, workers, 2 * workers, v)
    world = workers * replicas
    orders = [
        warm_up_order(Layout(world, rank, workers, plan.placement), tied) for rank in range(world)
    ]
    assert all(order == orders[0] for order in orders)  # derived alike on every rank
    ops = {rank: device_ops(orders[rank], rank) for rank in range(world)}
    assert replay(ops) == len(orders[0])  # every operation completes, one at a time


@pytest.mark.parametrize(("workers", "replicas", "name", "v", "tied"), SHAPES)
def test_every_communicator_a_step_uses_is_warmed(
    workers: int, replicas: int, name: str, v: int, tied: list[tuple[int, ...]]
) -> None:
    plan = build_schedule(name, workers, 2 * workers, v)
    world = workers * replicas
    order = warm_up_order(Layout(world, 0, workers, plan.placement), tied)
    pairs = {op.ranks for op in order if op.group == "pair"}
    for message in message_order(plan.actions, plan.placement):  # every boundary value's pair
        for q in range(replicas):
            a, b = q * workers + message.src, q * workers + message.dst
            assert (min(a, b), max(a, b)) in pairs, (message, q)
    groups = {(op.group, op.ranks) for op in order if op.group != "pair"}
    want = {("p2p", tuple(range(world)))}
    for rank in range(world):
        layout = Layout(world, rank, workers, plan.placement)
        want.add(("pipeline", tuple(layout.pipeline_ranks)))
        if replicas > 1:
            want.add(("replica", tuple(layout.replica_ranks)))
        want |= {("tied", tuple(layout.replica * workers + i for i in ws)) for ws in tied}
    assert groups == want
    assert len(order) == len(set(order))  # each once


def test_orders_that_differ_between_ranks_deadlock() -> None:
    """What the one order prevents: ranks that each order their own groups (ranks 1 and 2 their
    replica group first, ranks 0 and 3 their pipeline group first) wait in a cycle, though each
    rank's list alone looks fine: 0 waits for 1 (pipeline), 1 for 3 (replica), 3 for 2
    (pipeline), 2 for 0 (replica)."""
    order = warm_up_order(Layout(4, 0, 2, (0, 1)))
    ops = {}
    for rank in range(4):
        mine = [op for op in order if rank in op.ranks]
        if rank in (1, 2):  # [p2p, pipeline, replica, pair] -> [p2p, replica, pipeline, pair]
            mine = [mine[0], mine[2], mine[1], *mine[3:]]
        ops[rank] = device_ops(mine, rank)
    with pytest.raises(Deadlock):
        replay(ops)


def test_tied_workers_are_each_set_of_pipeline_ranks_holding_one_tied_parameter() -> None:
    shared = [[(0, "weight"), (5, "weight")], [(1, "w"), (2, "w")], [(0, "b"), (4, "b")]]
    # layers 0-1 on stage 0 (worker 0), 2-3 on stage 1 (worker 1), 4-5 on stage 2 (worker 0)
    assert tied_workers(shared, [2, 2, 2], [0, 1, 0]) == [(0, 1)]  # (0, 0) is one rank: none


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


def test_warm_up_issues_its_order_on_the_pipes_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 of K=2 x R=2: the world's group, its pipeline group, its replica group, the tied
    group, then its message from rank 2, each waited before the next."""
    calls: list[tuple[str, Any, int]] = []

    def collective(value: torch.Tensor, group: Any, async_op: bool) -> _Done:
        calls.append(("all_reduce", group, -1))
        return _Done()

    def p2p(call: str) -> Any:
        def issue(value: torch.Tensor, peer: int, group: Any, tag: int) -> _Done:
            assert tag == layout_module.WARM_UP
            calls.append((call, group, peer))
            return _Done()

        return issue

    monkeypatch.setattr(dist, "all_reduce", collective)
    monkeypatch.setattr(dist, "isend", p2p("isend"))
    monkeypatch.setattr(dist, "irecv", p2p("irecv"))
    tied = object()
    monkeypatch.setattr(layout_module, "tied_group", lambda layout, workers, t, d: tied)
    groups = Groups(object(), object(), object(), object(), object(), object())
    layout = Layout(4, 3, 2, (0, 1))
    done = layout_module.warm_up(layout, groups, [(0, 1)], torch.device("cpu"), 5.0)
    assert [(op.group, op.ranks) for op in done] == [
        ("p2p", (0, 1, 2, 3)),
        ("pipeline", (2, 3)),
        ("replica", (1, 3)),
        ("tied", (2, 3)),
        ("pair", (2, 3)),
    ]
    assert calls == [
        ("all_reduce", groups.p2p, -1),
        ("all_reduce", groups.pipeline, -1),
        ("all_reduce", groups.replica, -1),
        ("all_reduce", tied, -1),
        ("irecv", groups.p2p, 2),
    ]
