"""Every NCCL communicator is made when the pipe is built, in one order all ranks agree on
(issue 32, item 6).

NCCL makes a group's communicator at its first operation and a pair's at its first send, each a
collective of its members; made lazily inside step 1, while other pairs' kernels already wait
on the GPU, creations can deadlock. ``layout.warm_up`` runs one operation on every device group
and every pair of pipeline ranks that exchange values, before step 1. Here every rank of each
shape runs the real ``warm_up`` (its calls recorded); each rank's calls are compared with what
that rank must warm up, derived from where it sits (its groups, the tied weights it holds, the
ranks the schedule's messages join it to), and all ranks' calls are replayed together under
NCCL's rule (``tests/support/nccl_rules.py``, every group its own communicator). The real
pipe on gloo: ``tests/unit/engine/distributed/test_k2_r2.py`` (its recorded calls).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from giantpipe.engine.distributed import layout as layout_module
from giantpipe.engine.distributed.layout import Groups, Layout, WarmUp, tied_workers, warm_up_order
from giantpipe.engine.distributed.message_order import message_order
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.schedules.actions import Schedule
from tests.support.nccl_rules import Deadlock, DeviceOp, replay

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


class Group(NamedTuple):
    """A stand-in device group: the communicator's name and its members."""

    name: str
    ranks: tuple[int, ...]


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


def issued(layout: Layout, tied: list[tuple[int, ...]]) -> list[DeviceOp]:
    """What the real ``warm_up`` issues on ``layout.rank``, in order (groups that stand for the
    ones ``build_groups`` makes; a tied group as ``tied_group`` makes it: the replica's ranks
    of the tied workers)."""
    calls: list[DeviceOp] = []

    def collective(value: torch.Tensor, group: Group, async_op: bool) -> _Done:
        calls.append(DeviceOp("collective", group=group.ranks, nbytes=4, comm=f"{group.name}"))
        return _Done()

    def p2p(kind: str) -> Any:
        def issue(value: torch.Tensor, peer: int, group: Group, tag: int) -> _Done:
            assert tag == layout_module.WARM_UP and group.name == "p2p"
            calls.append(DeviceOp(kind, peer, nbytes=4, comm="p2p"))
            return _Done()

        return issue

    def tied_group(layout: Layout, workers: list[int], timeout: float, device: Any) -> Group:
        ranks = tuple(layout.replica * layout.workers + w for w in workers)
        return Group(f"tied{list(ranks)}", ranks)

    w, q = layout.workers, layout.replica
    world = tuple(range(layout.world_size))
    pipeline = tuple(q * w + i for i in range(w))
    replica = tuple(r * w + layout.worker for r in range(layout.replicas))
    host = Group("host", ())  # the step's host groups: a warm-up operation there fails
    groups = Groups(
        Group("p2p", world), host, Group(f"pipeline{list(pipeline)}", pipeline),
        Group(f"replica{list(replica)}", replica) if layout.replicas > 1 else None, host, host,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "all_reduce", collective)
        patch.setattr(dist, "isend", p2p("send"))
        patch.setattr(dist, "irecv", p2p("recv"))
        patch.setattr(layout_module, "tied_group", tied_group)
        layout_module.warm_up(layout, groups, tied, torch.device("cpu"), 5.0)
    return calls


def must_warm(layout: Layout, tied: list[tuple[int, ...]], plan: Schedule) -> list[str]:
    """What ``layout.rank`` must warm up, in the documented order, from where it sits: the
    world's group, its pipeline (its replica's ranks), its stage's replicas, each tied weight's
    ranks it is one of, then each rank of its pipeline that the step's messages join it to."""
    w, q, me = layout.workers, layout.replica, layout.worker
    want = [f"collective {list(range(layout.world_size))}"]
    want.append(f"collective {[q * w + i for i in range(w)]}")
    if layout.replicas > 1:
        want.append(f"collective {[r * w + me for r in range(layout.replicas)]}")
    want += [f"collective {[q * w + i for i in ws]}" for ws in tied if me in ws]
    messages = message_order(plan.actions, plan.placement)
    peers = {m.dst if m.src == me else m.src for m in messages if me in (m.src, m.dst)}
    want += [f"pair {sorted([layout.rank, q * w + p])}" for p in sorted(peers)]
    return want


def seen(op: DeviceOp, rank: int) -> str:
    if op.kind == "collective":
        return f"collective {list(op.group)}"
    return f"pair {sorted([rank, op.peer])}"


@pytest.mark.parametrize(("workers", "replicas", "name", "v", "tied"), SHAPES)
def test_each_rank_warms_what_it_uses_and_all_ranks_replay_under_nccls_rule(
    workers: int, replicas: int, name: str, v: int, tied: list[tuple[int, ...]]
) -> None:
    plan = build_schedule(name, workers, 2 * workers, v)
    world = workers * replicas
    layouts = [Layout(world, rank, workers, plan.placement) for rank in range(world)]
    ops = {layout.rank: issued(layout, tied) for layout in layouts}
    for layout in layouts:
        got = [seen(op, layout.rank) for op in ops[layout.rank]]
        assert got == must_warm(layout, tied, plan), layout.rank
    distinct = {seen(op, rank) + op.comm for rank, rank_ops in ops.items() for op in rank_ops}
    assert replay(ops) == len(distinct)  # the ranks' own calls: every one completes


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
