"""Every schedule is transparent: loss, gradients and BatchNorm statistics equal the plain model's
under every re-materialization mode; and each holds the activations its schedule promises."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.perf.balance import solve_balance
from giantpipe.testing import reference_step, step_seed
from tests.unit.engine.engine_helpers import tuple_batch, tuple_model

MODES = ["always", "except_last", "never"]


def assert_same_grads(pipe: nn.Module, plain: nn.Module) -> None:
    # Workers run with fewer intra-op threads than the reference, so reductions add up in
    # another order: float noise of ~1e-6 relative; a real error (a lost or doubly counted
    # micro-batch, a wrong scale) is of order one.
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


# (schedule, K, V, M): tuple_model has 6 layers, so K*V <= 6.
CASES = [
    ("1f1b", 2, 1, 1),
    ("1f1b", 2, 1, 4),
    ("1f1b", 3, 1, 7),
    ("zb-h1", 2, 1, 1),
    ("zb-h1", 2, 1, 4),
    ("zb-h1", 3, 1, 7),
    ("interleaved", 2, 2, 4),
    ("interleaved", 3, 2, 3),
    ("interleaved", 2, 3, 2),
    ("gpipe", 2, 2, 3),
    ("zb-v", 2, 2, 1),
    ("zb-v", 2, 2, 5),
    ("zb-v", 3, 2, 4),
]


@pytest.mark.parametrize(("schedule", "k", "v", "chunks"), CASES)
@pytest.mark.parametrize("mode", MODES)
def test_schedule_matches_plain_model(schedule: str, k: int, v: int, chunks: int, mode: str):
    model = tuple_model()
    inputs, target = tuple_batch()
    balance = solve_balance([1.0] * len(model), k * v)
    plain, ref_loss = reference_step(model, inputs, target, chunks, step_seed(11))

    pipe = GPipe(
        copy.deepcopy(model),
        balance,
        devices=["cpu"] * k,
        chunks=chunks,
        recompute=mode,
        schedule=schedule,
        virtual_stages=v,
    )
    torch.manual_seed(11)
    loss = pipe.train_step(inputs, target, nn.functional.cross_entropy)

    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert_same_grads(pipe, plain)
    for (name, b), (_, c) in zip(pipe.named_buffers(), plain.named_buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-7, msg=name)
    stats = pipe.last_stats
    assert stats is not None and len(stats.busy_time_s) == k
    assert len(stats.peak_memory_bytes) == k


def test_interleaved_front_door_runs_looped_fill_drain() -> None:
    model = tuple_model()
    inputs, target = tuple_batch()
    plain, ref_loss = reference_step(model, inputs, target, 3, step_seed(4))
    pipe = GPipe(
        copy.deepcopy(model),
        [1] * 6,
        devices=["cpu"] * 3,
        chunks=3,
        schedule="interleaved",
        virtual_stages=2,
    )
    torch.manual_seed(4)
    loss = nn.functional.cross_entropy(pipe(inputs), target)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert_same_grads(pipe, plain)


def test_zb_v_front_door_runs_fill_drain_on_its_v_placement() -> None:
    model = tuple_model()
    inputs, target = tuple_batch()
    plain, ref_loss = reference_step(model, inputs, target, 3, step_seed(4))
    pipe = GPipe(copy.deepcopy(model), [2, 1, 1, 2], devices=["cpu"] * 2, chunks=3,
                 schedule="zb-v")  # fmt: skip
    assert pipe.placement == [0, 1, 1, 0] and pipe.virtual_stages == 2
    torch.manual_seed(4)
    loss = nn.functional.cross_entropy(pipe(inputs), target)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert_same_grads(pipe, plain)


def test_recompute_runs_once_per_microbatch_with_split_backward() -> None:
    calls: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(torch.is_grad_enabled())
            return x * 2

    model = nn.Sequential(nn.Linear(4, 4), Probe(), nn.Linear(4, 4), nn.Linear(4, 1))
    pipe = GPipe(model, [2, 2], devices=["cpu"] * 2, chunks=3, recompute="always", schedule="zb-h1")
    pipe.train_step(torch.randn(6, 4), torch.randn(6, 1), nn.functional.mse_loss)
    # stage 0 runs F0 F1 B0 W0 F2 B1 W1 B2 W2: each B recomputes once, no W recomputes
    assert calls == [False, False, True, False, True, True]


def test_schedule_errors() -> None:
    model = tuple_model()
    with pytest.raises(ValueError, match="multiple of the number of workers"):
        GPipe(model, [1] * 6, devices=["cpu"] * 3, chunks=4, schedule="interleaved")
    with pytest.raises(ValueError, match="balance must list K\\*V stages"):
        GPipe(model, [3, 2, 1], devices=["cpu"] * 3, chunks=3, schedule="interleaved")
    with pytest.raises(ValueError, match="use 'interleaved' for virtual stages"):
        GPipe(model, [2, 2, 1, 1], devices=["cpu"] * 2, schedule="1f1b", virtual_stages=2)


def deep_mlp(depth: int = 8, width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


def peaks(schedule: str, k: int, chunks: int) -> tuple[list[int], list[int]]:
    pipe = GPipe(
        deep_mlp(),
        [8 // k] * k,
        devices=["cpu"] * k,
        chunks=chunks,
        recompute="never",
        schedule=schedule,
    )
    pipe.train_step(
        torch.randn(8 * chunks, 32), torch.randn(8 * chunks, 32), nn.functional.mse_loss
    )
    assert pipe.last_stats is not None
    return pipe.last_in_flight, pipe.last_stats.peak_memory_bytes


@pytest.mark.parametrize("k", [2, 4])
def test_peak_in_flight_activations_per_stage(k: int) -> None:
    m = 8
    held, gpipe_bytes = peaks("gpipe", k, m)
    assert held == [m] * k  # GPipe without re-materialization holds all M
    per_microbatch = [b // m for b in gpipe_bytes]
    held, one_bytes = peaks("1f1b", k, m)
    assert held == [k - s for s in range(k)]  # 1F1B: at most K, K-s on stage s
    assert one_bytes == [(k - s) * b for s, b in enumerate(per_microbatch)]
    held, zb_bytes = peaks("zb-h1", k, m)
    assert held == [k] * k  # ZB-H1 keeps graphs until W, yet never more than K
    assert zb_bytes == [k * b for b in per_microbatch]


@pytest.mark.parametrize("mode", MODES)
def test_split_backward_releases_the_graph_after_w(mode: str) -> None:
    refs: list[weakref.ref] = []

    class Keep(nn.Module):
        """tanh saves its output for backward: alive exactly as long as the graph is."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(x)
            refs.append(weakref.ref(y))
            return y * 2

    model = nn.Sequential(nn.Linear(4, 4), Keep(), nn.Linear(4, 4), Keep(), nn.Linear(4, 1))
    pipe = GPipe(model, [2, 3], devices=["cpu"] * 2, chunks=3, recompute=mode, schedule="zb-h1")
    pipe.train_step(torch.randn(6, 4), torch.randn(6, 1), nn.functional.mse_loss)
    gc.collect()
    assert refs and all(r() is None for r in refs)


@pytest.mark.parametrize("input_grad", [False, True])
def test_a_split_b_with_nothing_to_hand_on_and_its_w_next_runs_the_whole_backward(
    monkeypatch: pytest.MonkeyPatch, input_grad: bool
) -> None:
    from giantpipe.engine import executor

    split: list[nn.Module] = []
    real = executor._backward_input

    def spy(tensors: list, grads: list, leaves: object, stage: nn.Module) -> object:
        split.append(stage)
        return real(tensors, grads, leaves, stage)

    monkeypatch.setattr(executor, "_backward_input", spy)
    model = deep_mlp(depth=4)
    x, y = torch.randn(16, 32, requires_grad=input_grad), torch.randn(16, 32)
    plain = copy.deepcopy(model)
    x_plain = x.detach().clone().requires_grad_(input_grad)
    nn.functional.mse_loss(plain(x_plain), y).backward()
    pipe = GPipe(model, [2, 2], devices=["cpu"] * 2, chunks=4, recompute="never",
                 schedule="zb-h1")  # fmt: skip
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    # zb-h1, K=2: stage 0 runs F0 F1 B0 W0 F2 B1 W1 ...; its data needs no gradient, so each
    # B there is a whole backward; stage 1 hands every input gradient on before its W
    stage0, stage1 = pipe.partitions
    assert sum(s is stage0 for s in split) == (4 if input_grad else 0)
    assert sum(s is stage1 for s in split) == 4
    assert loss.item() == pytest.approx(nn.functional.mse_loss(plain(x_plain), y).item(), rel=1e-5)
    assert_same_grads(pipe, plain)
