"""The transport (engine/distributed/p2p.py) on threads that stand in for ranks
(tests/support/nccl_rules.py's FakeNetwork): one host message starts each step, values are
described on the host only in the first step of a layout of the step's inputs, then cross as
their bytes alone; a value whose layout changes while the inputs keep theirs, and a rank in
another step, fail with a line that names them. Real gloo ranks: tests/distributed/
test_transport.py; NCCL's order: tests/distributed/test_nccl_order.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from giantpipe.engine.distributed.faults import RankFailure
from giantpipe.engine.distributed.layout import Layout
from giantpipe.engine.distributed.p2p import DESCRIPTIONS, PAYLOADS, STARTS, P2PMailbox
from giantpipe.engine.distributed.wire import Layouts
from giantpipe.engine.schedules import build_schedule
from tests.support.nccl_rules import FakeNetwork

# The steps of a round trip, and the layout of their inputs (what stage 0's rank names).
FIRST, STEADY, SMALLER, LONG, BACK = range(5)
INPUTS = {FIRST: "usual", STEADY: "usual", SMALLER: "smaller", LONG: "long", BACK: "usual"}
LEARNING = [FIRST, SMALLER, LONG]


def value_of(step: int, kind: str, m: int) -> Any:
    """What crosses under ``(kind, ., m)`` in ``step``: a decoder's activations (a strided float
    tensor, a bool mask, int32 positions, a plain int), gradients (a float tensor, None for
    the mask, an int64 tensor). SMALLER shrinks the last micro-batch; LONG is a tuple whose
    description takes two host messages."""
    g = torch.Generator().manual_seed(100 * step + 10 * m + (kind == "grad"))
    rows = 9 if step == SMALLER and m == 1 else 16
    if step == LONG:
        return tuple(torch.randn(1, 1, 1, 1, 1, 1, 1, 2, generator=g) for _ in range(12))
    if kind == "act":
        leaf = torch.randn(8, rows, generator=g, requires_grad=True)
        return (
            (leaf * 2).t(),  # not contiguous, requires grad (a non-leaf)
            torch.rand(rows, 8, generator=g) > 0.5,
            torch.arange(8, dtype=torch.int32) + m,
            rows,
        )
    return (torch.randn(rows, 8, generator=g), None, torch.tensor([m, step]))


def same(sent: Any, got: Any) -> bool:
    if isinstance(sent, torch.Tensor):
        return sent.dtype == got.dtype and sent.shape == got.shape and torch.equal(sent, got)
    if isinstance(sent, tuple):
        return len(sent) == len(got) and all(same(a, b) for a, b in zip(sent, got))
    return bool(sent == got) and type(sent) is type(got)


Play = Callable[[P2PMailbox, int, int], None]


def gpipe_k2(box: P2PMailbox, rank: int, step: int) -> None:
    """One rank's share of a GPipe step, K=2, M=2, as StepRun runs it; checks what it gets."""
    for kind, stage, m in build_schedule("gpipe", 2, 2).actions[rank]:
        if kind == "F" and stage == 0:
            box.put(("act", 1, m), value_of(step, "act", m))
        elif kind == "F":
            got = box.get(("act", 1, m))
            assert same(value_of(step, "act", m), got), (step, m)
            assert not any(t.requires_grad for t in got if isinstance(t, torch.Tensor))
        elif stage == 1:
            box.put(("grad", 0, m), value_of(step, "grad", m))
        else:
            assert same(value_of(step, "grad", m), box.get(("grad", 0, m))), (step, m)


def run(
    steps: list[int], play: Play = gpipe_k2, timeout: float = 5.0
) -> tuple[dict[int, list[Any]], dict[Any, Any]]:
    """Both ranks of K=2 play ``steps`` on threads; returns what each rank sent and received
    in each step, and per rank the seed it started each step with, or what it raised."""
    plan, net, group = build_schedule("gpipe", 2, 2), FakeNetwork(2), object()
    out: dict[Any, Any] = {}
    marks: dict[int, list[int]] = {0: [], 1: []}

    def rank_main(rank: int) -> None:
        net.as_rank(rank)
        layout, layouts = Layout(2, rank, 2, plan.placement), Layouts()
        seeds = out[rank] = []
        try:
            for step in steps:
                marks[rank].append(len(net.log[rank]))
                box = P2PMailbox(layout, group, group, timeout, layouts=layouts)
                given = (40 + step, INPUTS[step]) if rank == 0 else ()
                seeds.append(box.start(plan.actions, *given))
                play(box, rank, step)
                box.finish()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[(rank, "failed")] = f"{type(exc).__name__}: {exc}"
        marks[rank].append(len(net.log[rank]))

    assert net.run(rank_main) == [], "a rank hung"
    logs = {r: [net.log[r][a:b] for a, b in zip(marks[r], marks[r][1:])] for r in (0, 1)}
    return logs, out


def test_values_are_described_once_per_input_layout_then_cross_as_bytes_alone() -> None:
    steps = [FIRST, STEADY, SMALLER, LONG, BACK]
    logs, out = run(steps)
    assert (0, "failed") not in out and (1, "failed") not in out, out
    assert out[0] == out[1] == [40 + s for s in steps]  # rank 1 started each with rank 0's seed
    for i, step in enumerate(steps):
        log = {r: logs[r][i] for r in (0, 1)}
        starts = [(e.kind, e.peer) for e in log[0] if e.tag == STARTS]
        assert starts == [("send", 1)], step  # one host message starts a step
        assert [(e.kind, e.peer) for e in log[1] if e.tag == STARTS] == [("recv", 0)]
        for rank, peer in ((0, 1), (1, 0)):
            told = [e for e in log[rank] if e.tag == DESCRIPTIONS and e.kind == "send"]
            sent = [e for e in log[rank] if e.tag == PAYLOADS and e.kind == "send"]
            assert len(sent) == 2 and all(e.peer == peer for e in sent), (step, rank)
            per_value = 2 if step == LONG else 1
            assert len(told) == (2 * per_value if step in LEARNING else 0), (step, rank)
    # bytes alone: a gradient's message is its tensors' bytes (16 x 8 floats, then two int64
    # at the next 64-byte boundary), the smaller last micro-batch's fewer
    grads = [e.nbytes for e in logs[1][STEADY] if e.tag == PAYLOADS and e.kind == "send"]
    assert grads == [16 * 8 * 4 + 16] * 2
    smaller = [e.nbytes for e in logs[1][SMALLER] if e.tag == PAYLOADS and e.kind == "send"]
    assert smaller == [320 + 16, 16 * 8 * 4 + 16]  # 9 x 8 floats padded to 320; m=1 first


def test_a_value_whose_layout_changes_while_the_inputs_keep_theirs_is_named() -> None:
    """A boundary shape that does not follow the inputs' (here a sequence grown in the second
    step of the same inputs' layout) would be a receive of the wrong size under NCCL: the
    sender refuses to send it, naming the value and both layouts."""

    def grown(box: P2PMailbox, rank: int, step: int) -> None:
        for kind, stage, m in build_schedule("gpipe", 2, 2).actions[rank]:
            rows = 3 if step == STEADY and m == 0 else 2
            if kind == "F" and stage == 0:
                box.put(("act", 1, m), (torch.ones(rows, 8), None))
            elif kind == "F":
                box.get(("act", 1, m))
            elif stage == 1:
                box.put(("grad", 0, m), torch.ones(rows, 8))
            else:
                box.get(("grad", 0, m))

    _, out = run([FIRST, STEADY], play=grown, timeout=1.0)
    assert out[(0, "failed")] == (
        "RuntimeError: rank 0 (stage 0): the activation of micro-batch 0 is (float32[3, 8], "
        "None), in a step whose inputs have the layout of an earlier step, where it was "
        "(float32[2, 8], None): a boundary value's dtypes, shapes and plain items must follow "
        "the layout of the step's inputs"
    )
    assert "timed out after 1s waiting for the activation of micro-batch 0" in out[(1, "failed")]


class Watched:
    """A receive of bytes whose waits are written down: ``(phase, a stream's wait (no
    timeout), the bytes already in when it began)``."""

    def __init__(self, work: Any, phase: list[str], waits: list[tuple[str, bool, bool]]) -> None:
        self.work, self.phase, self.waits = work, phase, waits

    def wait(self, timeout: Any = None) -> bool:
        self.waits.append((self.phase[0], timeout is None, self.work.is_completed()))
        return bool(self.work.wait(timeout))

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def test_on_the_device_the_host_never_waits_for_bytes_inside_a_step() -> None:
    """NCCL's rule for the host: it runs ahead of the GPU, so a receive of bytes only makes the
    consumer's stream wait (a wait without a timeout), and the step's transfers are asked
    whether they succeeded once they ran (``check`` after the step's device wait, or earlier
    when found complete), each once. Rank 1 takes
    the device path; rank 0 makes each value a little late, so no receive is in when waited."""
    plan, net, group = build_schedule("gpipe", 2, 2), FakeNetwork(2), object()
    phase, waits = ["start"], []
    real_irecv = net.irecv

    def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Any:
        work = real_irecv(tensor, src, group, tag)
        return Watched(work, phase, waits) if net.rank == 1 and tag == PAYLOADS else work

    def late(box: P2PMailbox, rank: int, step: int) -> None:
        real_put = box.put

        def put(key: Any, value: Any) -> None:
            time.sleep(0.05)
            real_put(key, value)

        box.put = put  # type: ignore[method-assign]
        gpipe_k2(box, rank, step)

    def rank_main(rank: int) -> None:
        net.as_rank(rank)
        layout, layouts = Layout(2, rank, 2, plan.placement), Layouts()
        for step in (FIRST, STEADY):
            phase[0] = f"step {step}"
            box = P2PMailbox(layout, group, group, 5.0, layouts=layouts)
            if rank == 1:
                box._on_device = lambda: True  # type: ignore[method-assign]
            box.start(plan.actions, *((40, "usual") if rank == 0 else ()))
            late(box, rank, step)
            box.finish()
            if rank == 1:  # what the pipe does after the step's device wait
                phase[0] = "check"
                box.check()

    net.irecv = irecv  # type: ignore[method-assign]
    assert net.run(rank_main) == [], "a rank hung"
    inside = [(where, stream, ready) for where, stream, ready in waits if where != "check"]
    assert all(stream or ready for _, stream, ready in inside), inside  # the host never waited
    # the steady step's activations, their receives issued ahead: the stream waited for both
    steady = [w[1:] for w in inside if w[0] == f"step {STEADY}" and w[1]]
    assert steady == [(True, False)] * 2
    asked = [ready for _, stream, ready in waits if not stream]  # each once, once it was in
    assert asked == [True] * 4


def test_a_rank_in_another_step_is_told_so() -> None:
    plan, net, group = build_schedule("gpipe", 2, 2), FakeNetwork(2), object()
    failure: list[str] = []

    def rank_main(rank: int) -> None:
        net.as_rank(rank)
        layout = Layout(2, rank, 2, plan.placement)
        layouts = Layouts(steps=1 if rank == 1 else 0)  # rank 1 believes a step ran before
        box = P2PMailbox(layout, group, group, 2.0, layouts=layouts)
        try:
            box.start(plan.actions, *((40, "usual") if rank == 0 else ()))
        except RankFailure as exc:
            failure.append(str(exc))

    net.run(rank_main)
    assert failure == [
        "rank 1 (stage 1) got the start of step 1 from rank 0 (stage 0), in its step 2: are "
        "all ranks running the same steps?"
    ]


def test_the_rank_holding_stage_0_must_name_its_seed_and_inputs() -> None:
    plan = build_schedule("gpipe", 2, 2)
    box = P2PMailbox(Layout(2, 0, 2, plan.placement), object(), object(), 1.0)
    with pytest.raises(ValueError, match="seed and inputs"):
        box.start(plan.actions)
