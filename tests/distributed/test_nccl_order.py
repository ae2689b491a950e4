"""The transport keeps NCCL's ordering rule, for every schedule, K <= 4, M <= 8, R <= 2.

Ranks are threads of this process talking through :class:`FakeNetwork` (no sockets, no
processes: the whole matrix runs in seconds). Each rank plays its actions of the schedule
against a :class:`P2PMailbox` as ``StepRun`` does (get the input, put the output) for four
steps: the first learns every layout (descriptions on the host), the second is the steady
state (bytes alone), the third has inputs of another layout and changes some shapes, the
fourth has the first's inputs again (bytes alone). A value with no tensor bytes crosses in
every step but the third. Every value must arrive equal, and the transfers each rank issued
must replay under NCCL's rule (:func:`tests.support.nccl_rules.replay`) and be exactly the
order the schedule implies.

The replay is shown to catch the fault it guards: ranks that issue their transfers in the
order of their own actions (not one order agreed by all) run on gloo, and deadlock under it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from giantpipe.engine.distributed import p2p
from giantpipe.engine.distributed.layout import Layout
from giantpipe.engine.distributed.message_order import Op, message_order, worker_ops
from giantpipe.engine.distributed.p2p import DESCRIPTIONS, PAYLOADS, P2PMailbox
from giantpipe.engine.distributed.wire import Layouts
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.schedules.actions import Action
from tests.distributed.workers import registered_schedules, virtual_stages_for
from tests.support.nccl_rules import Deadlock, DeviceOp, FakeNetwork, replay

STEPS = 4
CHANGED = 2  # the step whose inputs (and so some shapes) differ from the others'
LEARNING = (0, CHANGED)  # the steps that send descriptions: a layout of inputs seen first


def value_of(step: int, key: tuple[str, int, int]) -> Any:
    """What crosses under ``key`` in ``step``: a float tensor whose rows change in step
    CHANGED, a bool mask and a plain int; but for CHANGED, the gradient of micro-batch 0
    carries no tensor bytes at all (an integer input's gradient is None)."""
    kind, stage, m = key
    if kind == "grad" and step != CHANGED and m == 0:
        return (None, 7)
    rows = 2 + (m % 3 if step == CHANGED else 0)
    code = float(1000 * step + 100 * (kind == "grad") + 10 * stage + m)
    return (torch.full((rows, 3), code), torch.arange(rows) % 2 == 0, m)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    return a == b


def play(box: Any, actions: Any, last: int, step: int, seen: list[str]) -> None:
    """One rank's actions as the executor runs them: its input got, its output put."""
    for kind, stage, m in actions:
        if kind == "W":
            continue
        got = ("act", stage, m) if kind == "F" and stage > 0 else None
        got = ("grad", stage, m) if kind == "B" and stage < last else got
        if got is not None:
            value = box.get(got)
            if not same(value, value_of(step, got)):
                seen.append(f"step {step}: {got} arrived wrong: {value}")
        put = ("act", stage + 1, m) if kind == "F" and stage < last else None
        put = ("grad", stage - 1, m) if kind == "B" and stage > 0 else put
        if put is not None:
            box.put(put, value_of(step, put))


def run_ranks(name: str, workers: int, chunks: int, replicas: int, shared: bool) -> Any:
    """Every rank of a K x R world plays STEPS steps on its own thread; returns the network,
    the schedule and any problem a rank saw."""
    v = virtual_stages_for(name, workers, chunks)
    plan = build_schedule(name, workers, chunks, v)
    world = workers * replicas
    net = FakeNetwork(world)
    host = object()
    group = host if shared else object()  # on CPU the host and device groups are one
    problems: list[str] = []

    def rank_main(rank: int) -> None:
        net.as_rank(rank)
        layout = Layout(world, rank, workers, plan.placement)
        layouts = Layouts()
        try:
            for step in range(STEPS):
                box = P2PMailbox(layout, host, group, 20.0, layouts=layouts)
                inputs = "changed" if step == CHANGED else "usual"
                given = (40 + step, inputs) if layout.needs_inputs else ()
                if box.start(plan.actions, *given) != 40 + step:
                    problems.append(f"rank {rank} step {step} learned seed {box.seed}")
                play(box, plan.actions[layout.worker], plan.num_stages - 1, step, problems)
                box.finish()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            problems.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    with net.installed():
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), f"{name} K={workers} M={chunks}: a rank hung"
    return net, plan, problems


def expected_ops(plan: Any, layout: Layout, step: int) -> list[tuple[str, int]]:
    """The transfers of bytes the agreed order implies for this rank in ``step``."""
    ops = []
    for op in worker_ops(plan.actions, plan.placement, layout.worker):
        kind, _, m = op.key
        empty = kind == "grad" and step != CHANGED and m == 0
        if not empty:
            ops.append((op.kind, layout.replica * layout.workers + op.peer))
    return ops


MATRIX = [
    (name, k, m, r)
    for name in registered_schedules()
    for k in (2, 3, 4)
    for m in range(1, 9)
    for r in (1, 2)
    if virtual_stages_for(name, k, m) is not None
]


@pytest.mark.parametrize("name", registered_schedules())
def test_every_step_replays_under_nccls_rule(name: str) -> None:
    cases = [c for c in MATRIX if c[0] == name]
    assert len(cases) >= 3 * 2 * 2, f"{name}: too few (K, M) accepted: {cases}"
    for _, k, m, r in cases:
        net, plan, problems = run_ranks(name, k, m, r, shared=(m % 2 == 0))
        assert not problems, f"{name} K={k} M={m} R={r}: {problems[:3]}"
        ops = net.device_ops(tags={PAYLOADS})
        assert replay(ops) > 0 or not message_order(plan.actions, plan.placement)
        described = net.device_ops(tags={DESCRIPTIONS})
        for rank, issued in ops.items():
            layout = Layout(k * r, rank, k, plan.placement)
            want = [e for step in range(STEPS) for e in expected_ops(plan, layout, step)]
            assert [(o.kind, o.peer) for o in issued] == want, f"{name} K={k} M={m} rank {rank}"
            # descriptions in the steps of a new input layout only, one per value sent
            sends = worker_ops(plan.actions, plan.placement, layout.worker)
            told = [o for o in described.get(rank, []) if o.kind == "send"]
            assert len(told) == len(LEARNING) * sum(o.kind == "send" for o in sends), rank


def own_order(
    actions: tuple[tuple[Action, ...], ...], placement: tuple[int, ...], worker: int
) -> tuple[Op, ...]:
    """The bug the agreed order prevents: a worker's transfers in the order of its own actions
    (the receive of an action's input, the send of its output), agreed with nobody."""
    last = len(placement) - 1
    ops = []
    for kind, stage, m in actions[worker]:
        inbound = [("act", stage, m, stage - 1)] if kind == "F" and stage > 0 else []
        inbound += [("grad", stage, m, stage + 1)] if kind == "B" and stage < last else []
        outbound = [("act", stage + 1, m, stage + 1)] if kind == "F" and stage < last else []
        outbound += [("grad", stage - 1, m, stage - 1)] if kind == "B" and stage > 0 else []
        for what, way in ((inbound, "recv"), (outbound, "send")):
            for k, s, mm, other in what:
                if placement[other] != worker:
                    ops.append(Op(way, (k, s, mm), placement[other]))
    return tuple(ops)


def test_the_replay_catches_transfers_in_each_ranks_own_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1F1B, K=2, M=2 with each rank's transfers in its own actions' order: rank 0 sends both
    activations before its first gradient comes back, rank 1 sends that gradient before it
    takes the second activation. Gloo's matching by tag hides it; under NCCL's rule the two
    sends wait for each other."""
    monkeypatch.setattr(p2p, "worker_ops", own_order)
    net, _, problems = run_ranks("1f1b", 2, 2, 1, shared=True)
    assert not problems  # every value arrived on gloo's terms ...
    with pytest.raises(Deadlock, match="rank 0: send .* rank 1: send"):
        replay(net.device_ops(tags={PAYLOADS}))  # ... NCCL's rule does not


def test_a_mismatched_order_is_a_deadlock_and_sizes_must_agree() -> None:
    send, recv = DeviceOp("send", 1, nbytes=4), DeviceOp("recv", 0, nbytes=4)
    back_send, back_recv = DeviceOp("send", 0, nbytes=4), DeviceOp("recv", 1, nbytes=4)
    assert replay({0: [send, back_recv], 1: [recv, back_send]}) == 2
    with pytest.raises(Deadlock):
        replay({0: [back_recv, send], 1: [recv, back_send]})
    with pytest.raises(AssertionError, match="size"):
        replay({0: [send], 1: [DeviceOp("recv", 0, nbytes=8)]})
    group = (0, 1)
    coll = DeviceOp("collective", group=group, nbytes=8, what="all_reduce")
    assert replay({0: [coll, send], 1: [coll, recv]}) == 2
    with pytest.raises(Deadlock):
        replay({0: [coll, send], 1: [recv, coll]})


def test_two_groups_over_the_same_ranks_in_opposite_orders_are_a_deadlock() -> None:
    """Two process groups over ranks 0 and 1 are two communicators: rank 0 issuing A then B
    while rank 1 issues B then A waits for ever under NCCL, however alike their members."""
    a = DeviceOp("collective", group=(0, 1), nbytes=8, what="all_reduce", comm="A")
    b = DeviceOp("collective", group=(0, 1), nbytes=8, what="all_reduce", comm="B")
    assert replay({0: [a, b], 1: [a, b]}) == 2
    with pytest.raises(Deadlock, match="on group A.*on group B"):
        replay({0: [a, b], 1: [b, a]})
    send = DeviceOp("send", 1, nbytes=4, comm="A")  # a pair's messages too: per communicator
    with pytest.raises(Deadlock):
        replay({0: [send], 1: [DeviceOp("recv", 0, nbytes=4, comm="B")]})


def as_device_ops(log: list[dict[str, Any]]) -> list[DeviceOp]:
    """A rank's recorded calls as the replay takes them: transfers of bytes and every
    collective (host ones too: a stricter check); host messages (gloo, tag-matched) left out."""
    ops = []
    for e in log:
        if e["call"] in ("isend", "irecv", "send", "recv"):
            if e["tag"] == PAYLOADS:
                kind = "send" if e["call"] in ("isend", "send") else "recv"
                op = DeviceOp(kind, e["peer"], nbytes=e["nbytes"], what="payload", comm=e["comm"])
                ops.append(op)
        else:
            group, comm = tuple(e["group"]), e["comm"]
            ops.append(
                DeviceOp("collective", group=group, nbytes=e["nbytes"], what=e["call"], comm=comm)
            )
    return ops


@pytest.mark.distributed
def test_real_steps_replay_under_nccls_rule(tmp_path) -> None:
    """K=2 x R=2 gloo processes, every schedule, M = 2 and 4: each step equals the plain model
    (BatchNorm, dropout, an integer mask, each stage on FSDP2 over its replicas: its
    all-gathers and reduce-scatters among the sends), every call to torch.distributed comes
    from the rank's main thread, and the device operations and collectives of all ranks
    replay under NCCL's rule."""
    from tests.support.ranks import spawn

    results = spawn(
        "tests.distributed.order_workers:recorded_steps",
        world=4,
        tmp=tmp_path,
        workers=2,
        chunks=[2, 4],
        modes=["except_last"],
    )
    ops = {}
    for result in results:
        names = {what.split()[0] for what, _ in result["checked"]}
        assert names == set(registered_schedules()), names
        log = result["log"]
        assert any(e["tag"] == PAYLOADS for e in log), "no transfer of bytes recorded"
        calls = {e["call"] for e in log}
        assert {"all_gather_single", "reduce_scatter_single"} <= calls, "FSDP2 not recorded"
        off_main = [e["call"] for e in log if not e["main_thread"]]
        assert not off_main, f"rank {result['rank']}: called from another thread: {off_main}"
        ops[result["rank"]] = as_device_ops(log)
    assert replay(ops) > 0
