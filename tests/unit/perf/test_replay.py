"""perf.predict.replay: the executor's own actions, each worker alone, feeding the simulator.
What is exact here: which actions ran, which cost fields they replace, and that nothing is left
behind. Whether the forecast is right is measured in benchmarks/schedules_cpu.py."""

from __future__ import annotations

import math
import threading
from collections import Counter

import pytest
import torch
from torch import nn

from giantpipe.engine.microbatch import scatter
from giantpipe.engine.recompute import recompute_stop
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.schedules.actions import Schedule
from giantpipe.engine.step_config import LossSpec, StepConfig
from giantpipe.perf.predict import CannedMailbox, replay
from giantpipe.perf.simulate import StageCost
from tests.unit.engine.engine_helpers import tuple_batch, tuple_model

SENTINEL = StageCost(
    forward=101.0,
    backward=102.0,
    backward_input=103.0,
    weight=104.0,
    forward_no_grad=105.0,
    recompute=106.0,
    send=107.0,
    input_bytes=108,
    activation_bytes=109,
    static_bytes=110,
)


def setup(
    schedule: str, mode: str, m: int = 4, v: int = 1
) -> tuple[StepConfig, list[torch.Tensor], Schedule]:
    torch.manual_seed(0)
    plan = build_schedule(schedule, 2, m, v)
    blocks = 2 * v
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(blocks * 2)])
    stages = [model[2 * s : 2 * s + 2] for s in range(blocks)]
    x, y = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
    targets = scatter(y, m)
    config = StepConfig(
        stages=stages,
        devices=[torch.device("cpu")] * blocks,
        recompute_stop=recompute_stop(mode, m),
        grad_enabled=True,
        seed=0,
        loss=LossSpec(nn.functional.mse_loss, targets, [1 / m] * m),
        threads_per_worker=1,
        placement=plan.placement,
    )
    return config, scatter(x, m), plan


@pytest.mark.parametrize(
    ("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
)
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_every_action_is_timed_once_per_pass(schedule: str, v: int, mode: str) -> None:
    config, micros, plan = setup(schedule, mode, v=v)
    replayed = replay(config, micros, plan, passes=2)
    ran = Counter(t.action for t in replayed.timings)
    assert ran == Counter({a: 2 for worker in plan.actions for a in worker})
    stop = config.recompute_stop
    for t in replayed.timings:
        a = t.action
        assert t.end >= t.start and 0.0 <= t.waited <= t.end - t.start
        # only a B of a re-materialized micro-batch replays the forward
        assert (t.recompute > 0) == (a.kind == "B" and a.microbatch < stop)
    assert replayed.contention >= 1.0


def measured_fields(schedule: str, mode: str) -> set[str]:
    config, micros, plan = setup(schedule, mode)
    cost = replay(config, micros, plan).costs([SENTINEL] * 2, config.recompute_stop)[1]
    return {
        name
        for name in ("forward", "backward", "backward_input", "weight", "forward_no_grad")
        + ("recompute", "send", "input_bytes", "activation_bytes", "static_bytes")
        if getattr(cost, name) != getattr(SENTINEL, name)
    }


@pytest.mark.parametrize(
    ("schedule", "mode", "replaced"),
    [
        ("gpipe", "never", {"forward", "backward"}),
        ("gpipe", "always", {"forward_no_grad", "recompute", "backward"}),
        ("1f1b", "except_last", {"forward", "forward_no_grad", "recompute", "backward"}),
        ("zb-h1", "never", {"forward", "backward_input", "weight"}),
        ("zb-h1", "always", {"forward_no_grad", "recompute", "backward_input", "weight"}),
    ],
)
def test_the_replay_replaces_exactly_the_times_it_observed(
    schedule: str, mode: str, replaced: set[str]
) -> None:
    # what no action of the schedule ran keeps the isolated profile's figure, and bytes and
    # send times always do
    assert measured_fields(schedule, mode) == replaced


def test_replay_leaves_gradients_buffers_and_threads_as_they_were() -> None:
    model = tuple_model()
    stages = [model[:3], model[3:]]
    inputs, target = tuple_batch()
    m = 2
    config = StepConfig(
        stages=stages,
        devices=[torch.device("cpu")] * 2,
        recompute_stop=1,
        grad_enabled=True,
        seed=0,
        loss=LossSpec(nn.functional.cross_entropy, scatter(target, m), [0.5, 0.5]),
    )
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    buffers = [b.clone() for b in model.buffers()]
    before = set(threading.enumerate())
    replayed = replay(config, scatter(inputs, m), build_schedule("1f1b", 2, m))
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), buffers))
    assert [t for t in threading.enumerate() if t not in before] == []  # its own pool: closed
    assert all(math.isfinite(t.work) for t in replayed.timings)


def test_canned_mailbox_hands_out_copies_and_drops_what_is_put() -> None:
    act, grad = torch.ones(2, 3), (torch.zeros(2, 3), None)
    box = CannedMailbox([[act]], [[grad]])
    box.put(("act", 0, 0), torch.full((2, 3), 7.0))
    got = box.get(("act", 0, 0))
    assert torch.equal(got, act) and got.data_ptr() != act.data_ptr()
    g, none = box.get(("grad", 0, 0))
    assert torch.equal(g, grad[0]) and g.data_ptr() != grad[0].data_ptr() and none is None
