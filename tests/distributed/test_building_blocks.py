"""The distributed executor's parts that need no second process: wire format, rank layout,
building on meta with a local slice, atomic shard files. (No ``distributed`` marker: fast.)"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from giantpipe.checkpoint.files import atomic_save
from giantpipe.engine.distributed.layout import Layout
from giantpipe.engine.distributed.meta import (
    allocate_layers,
    build_on_meta,
    init_layers,
    seeded_init,
)
from giantpipe.engine.distributed.p2p import expected_receives, receive_plan
from giantpipe.engine.distributed.wire import (
    allocate,
    as_bytes,
    decode,
    encode,
    extra_words,
    header,
    prefix_of,
    words_of,
)
from giantpipe.engine.schedules import build_schedule


def roundtrip(value: object, seed: int = 7) -> object:
    words, tensors = encode(value)
    head, extra = header(words, seed, ("grad", 3, 11))
    # what the receiver reads of it (an announcement of len(words) words), as p2p reads it
    assert prefix_of(as_bytes(head)) == (len(words), seed, ("grad", 3, 11), 0)
    assert (extra is None) == (extra_words(head) == 0)
    received, buffers = allocate(decode(words_of(head, extra)), torch.device("cpu"))
    sent = [as_bytes(t) for t in tensors if t.numel()]
    assert len(sent) == len(buffers)
    for src, dst in zip(sent, buffers):
        dst.copy_(src)
    return received


def test_wire_carries_tuples_of_any_dtype_shape_and_plain_items() -> None:
    value = (
        torch.randn(3, 5).t(),  # not contiguous
        torch.tensor([[True, False]]),
        torch.arange(4, dtype=torch.int32),
        torch.tensor(2.5, dtype=torch.bfloat16),  # 0-dim
        torch.zeros(0, 7),  # empty: no bytes travel
        None,
        -3,
        0.25,
        False,
    )
    got = roundtrip(value)
    assert isinstance(got, tuple) and len(got) == len(value)
    for a, b in zip(value, got):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        else:
            assert a == b and type(a) is type(b)
    lone = torch.randn(2, 3)
    assert torch.equal(roundtrip(lone), lone)


def test_wire_long_descriptions_use_an_extra_message() -> None:
    value = tuple(torch.ones([1] * 8) for _ in range(12))
    words, _ = encode(value)
    assert extra_words(header(words)[0]) > 0
    assert all(torch.equal(t, torch.ones([1] * 8)) for t in roundtrip(value))


def test_wire_rejects_what_cannot_travel() -> None:
    with pytest.raises(TypeError, match="str"):
        encode((torch.ones(1), "text"))


def test_layout_of_two_stages_times_two_replicas() -> None:
    ranks = [Layout(world_size=4, rank=r, workers=2, placement=(0, 1)) for r in range(4)]
    assert [(lay.replica, lay.worker) for lay in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ranks[3].pipeline_ranks == [2, 3] and ranks[3].replica_ranks == [1, 3]
    assert [lay.needs_inputs for lay in ranks] == [True, False, True, False]
    assert ranks[2].label() == "rank 2 (stage 0)" and ranks[2].label(1) == "rank 3 (stage 1)"
    with pytest.raises(ValueError, match="multiple"):
        Layout(world_size=3, rank=0, workers=2, placement=(0, 1))


def test_receives_follow_the_schedule_including_interleaved_stages() -> None:
    plan = build_schedule("interleaved", 2, 2, 2)  # 4 stages, worker 0 holds 0 and 2
    layout = Layout(world_size=2, rank=0, workers=2, placement=plan.placement)
    keys = expected_receives(plan.actions[0], layout)
    assert set(keys) == {1}  # everything comes from rank 1
    # stage 2 gets activations from stage 1 and gradients from stage 3; stage 0 from stage 1
    want = [(kind, s, m) for kind, s in (("act", 2), ("grad", 0), ("grad", 2)) for m in (0, 1)]
    assert sorted(keys[1]) == sorted(want)
    consumed = [
        k
        for a in plan.actions[0]
        for k in keys[1]
        if k[1:] == (a.stage, a.microbatch) and (k[0] == "act") == (a.kind == "F")
    ]
    assert consumed == keys[1]  # in the order rank 0 consumes them


def test_receive_plan_is_each_peers_sending_order_and_cached() -> None:
    plan = build_schedule("1f1b", 2, 3)
    last = Layout(world_size=2, rank=1, workers=2, placement=plan.placement)
    first = Layout(world_size=2, rank=0, workers=2, placement=plan.placement)
    assert receive_plan(plan.actions, last) == ((0, (("act", 1, 0), ("act", 1, 1), ("act", 1, 2))),)
    assert receive_plan(plan.actions, first) == (
        (1, (("grad", 0, 0), ("grad", 0, 1), ("grad", 0, 2))),
    )
    # ZB-V: rank 0 holds stages 0 and 3, so it gets stage 1's activations and stage 2's
    # gradients, interleaved in the order rank 1 runs its actions.
    zbv = build_schedule("zb-v", 2, 2, 2)
    order = receive_plan(zbv.actions, Layout(2, 0, 2, zbv.placement))[0][1]
    sent = [
        ("act", 3, a.microbatch) if a.kind == "F" else ("grad", 0, a.microbatch)
        for a in zbv.actions[1]
        if (a.kind, a.stage) in {("F", 2), ("B", 1)}
    ]
    assert order == tuple(sent)
    hits = receive_plan.cache_info().hits
    receive_plan(plan.actions, last)
    assert receive_plan.cache_info().hits == hits + 1


class Positions(nn.Module):
    """A layer with a buffer computed in __init__ (like sinusoidal positions) and a parameter
    used twice (shared inside the layer)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.sin(torch.arange(d) / math.pi), persistent=False)
        self.proj = nn.Linear(d, d)
        self.again = self.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.again(self.proj(x) + self.table)


def build() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), Positions(6), nn.Linear(6, 2))


def test_meta_build_allocates_only_the_local_layers_with_the_plain_values() -> None:
    plain = build()
    init_layers(plain, seed=11)
    model = build_on_meta(build)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert torch.equal(model[2].table, plain[2].table)  # buffers are real from the start
    allocate_layers(model, [2, 3], torch.device("cpu"), seeded_init(11))
    assert all(p.device.type == "meta" for p in model[0].parameters())  # never allocated
    assert model[2].proj is model[2].again  # sharing inside a layer survives
    for name, value in model[2:].state_dict().items():
        assert torch.equal(value, plain[2:].state_dict()[name]), name
    x = torch.randn(3, 6)
    assert torch.equal(model[2:](x), plain[2:](x))


def test_a_model_built_entirely_on_meta_is_allocated_too() -> None:
    def small() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))

    plain = small()
    init_layers(plain, seed=2)
    with torch.device("meta"):
        model = small()
    allocate_layers(model, [1, 2], torch.device("cpu"), seeded_init(2))
    for name, value in model[1:].state_dict().items():
        assert torch.equal(value, plain[1:].state_dict()[name]), name


def test_seeded_init_does_not_disturb_the_callers_random_stream() -> None:
    model = build()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    init_layers(model, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_atomic_save_leaves_the_old_file_when_writing_fails(tmp_path) -> None:
    path = tmp_path / "shard.pt"
    atomic_save({"a": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self) -> tuple:
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_save({"a": Unpicklable()}, path)
    assert torch.equal(torch.load(path)["a"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["shard.pt"]


# ---- the failure board: who failed first ------------------------------------------------------


class DictStore:
    """The four calls of a c10d store the failure board makes."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def board_of(rank: int, store: DictStore, layout: Layout, pid: int | None = None):
    from giantpipe.engine.distributed.faults import FailureBoard

    board = FailureBoard(store, layout.rank_label(rank))
    board.watch(rank, layout.pipeline_ranks + layout.replica_ranks, layout.rank_label)
    if pid is not None:  # another process plays this rank
        key = f"giantpipe/process/{rank}"
        store.data[key] = store.data[key].replace(str(os.getpid()).encode(), str(pid).encode())
    return board


def test_a_dead_peer_is_named_first_by_what_a_survivor_reports() -> None:
    from giantpipe.engine.distributed.faults import explain, failure_message, is_consequence
    from giantpipe.engine.failures import note_failure
    from giantpipe.engine.schedules.actions import Action

    layout = Layout(world_size=3, rank=0, workers=3, placement=(0, 1, 2))
    store = DictStore()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: no /proc entry
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie.kill()  # not waited for: a zombie until reaped, yet its process ended
    time.sleep(0.5)
    try:
        board_of(1, store, layout, pid=zombie.pid)
        board_of(2, store, layout)  # alive: this process
        board = board_of(0, store, layout)
        assert board.gone() == f"rank 1 (stage 1) is gone (process {zombie.pid} ended)"
        # A transport error in one of this rank's actions is blamed on the dead peer.
        error = RuntimeError("[gloo/pair.cc:598] Connection reset by peer")
        note_failure(error, Action("F", 0, 3), torch.device("cpu"))
        assert is_consequence(error) and not is_consequence(ValueError("connection"))
        first = failure_message(error, layout, board)
        assert first == (
            f"rank 1 (stage 1) is gone (process {zombie.pid} ended); then rank 0 (stage 0) "
            "failed on micro-batch 3: RuntimeError: [gloo/pair.cc:598] Connection reset by peer"
        )
        # Every later report leads with it; a message naming the dead rank is left as it is.
        later = explain(board_of(2, store, layout), "rank 2 (stage 2): a peer is gone")
        assert later == f"{first} [then rank 2 (stage 2): a peer is gone]"
        named = "rank 1 (stage 1) is gone (connection closed); rank 0 (stage 0) waited"
        assert board_of(0, DictStore(), layout).blame(named, grace=0) == named
    finally:
        zombie.wait()
    store.data["giantpipe/process/1"] = f"{socket.gethostname()} {dead.pid}".encode()
    assert (
        board_of(0, store, layout).gone() == f"rank 1 (stage 1) is gone (process {dead.pid} ended)"
    )


def test_an_own_failure_is_reported_at_once_and_alive_peers_are_not_blamed() -> None:
    from giantpipe.engine.distributed.faults import explain

    layout = Layout(world_size=2, rank=0, workers=2, placement=(0, 1))
    store = DictStore()
    board_of(1, store, layout)
    board = board_of(0, store, layout)
    assert board.gone() is None
    start = time.monotonic()
    own = "rank 0 (stage 0) failed on micro-batch 1: ValueError: boom"
    assert explain(board, own, consequence=False) == own
    assert time.monotonic() - start < 0.5  # no grace for its own failure
    later = explain(board_of(1, store, layout), "rank 1 (stage 1) timed out")
    assert later == f"{own} [then rank 1 (stage 1) timed out]"
