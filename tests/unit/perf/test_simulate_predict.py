"""predict(pipe, ...): the simulator fed with measured stage costs. Timing accuracy is measured in
benchmarks/schedules_cpu.py; here, what is exact: memory, and that profiling leaves no trace."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.perf.predict import predict
from tests.unit.engine.engine_helpers import tuple_batch, tuple_model


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])


@pytest.mark.parametrize(
    ("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
)
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_predicted_activation_memory_equals_the_executors(schedule: str, v: int, mode: str):
    pipe = GPipe(
        mlp(),
        [8 // (2 * v)] * (2 * v),
        devices=["cpu"] * 2,
        chunks=4,
        checkpoint=mode,
        schedule=schedule,
        virtual_stages=v,
    )
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    prediction = predict(pipe, x, y, nn.functional.mse_loss, repeats=1)
    pipe.train_step(x, y, nn.functional.mse_loss)
    assert pipe.last_stats is not None
    assert prediction.simulation.peak_activation_bytes == pipe.last_stats.peak_memory_bytes
    params = [sum(p.numel() * 4 for p in s.parameters()) for s in pipe.partitions]
    static = [0, 0]
    for s, w in enumerate(pipe.placement):
        static[w] += 2 * params[s]  # weights + gradients
    assert prediction.peak_memory_bytes == [
        a + b for a, b in zip(pipe.last_stats.peak_memory_bytes, static)
    ]
    assert prediction.step_time_s > 0 and 0 <= prediction.bubble < 1
    assert prediction.samples_per_s == pytest.approx(16 / prediction.step_time_s)


def test_predict_leaves_gradients_statistics_and_threads_alone() -> None:
    model = tuple_model()
    inputs, target = tuple_batch()
    pipe = GPipe(model, [3, 3], devices=["cpu"] * 2, chunks=2, schedule="1f1b")
    pipe.train_step(inputs, target, nn.functional.cross_entropy)
    grads = [p.grad.clone() for p in pipe.parameters()]
    buffers = [b.clone() for b in pipe.buffers()]
    threads = torch.get_num_threads()
    # Other tests (tqdm's monitor, say) may leave daemon threads behind; only ours count.
    before = set(threading.enumerate())
    prediction = predict(pipe, inputs, target, nn.functional.cross_entropy, repeats=1)
    for p, g in zip(pipe.parameters(), grads):
        assert torch.equal(p.grad, g)
    for b, c in zip(pipe.buffers(), buffers):
        assert torch.equal(b, c)
    assert torch.get_num_threads() == threads
    assert [t for t in threading.enumerate() if t not in before] == []
    costs = prediction.costs
    assert len(costs) == 2 and all(c.forward > 0 and c.backward > 0 for c in costs)
    assert prediction.as_dict().keys() == {
        "step_time_s",
        "samples_per_s",
        "bubble",
        "peak_memory_bytes",
        "contention",
    }
    assert prediction.contention >= 1.0 and prediction.overhead_s > 0


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_predict_under_autocast_keeps_it_in_the_replays_threads() -> None:
    # the replay's threads start with autocast off; bf16 inputs then met fp32 weights
    pipe = GPipe(mlp(), [4, 4], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prediction = predict(pipe, x, y, nn.functional.mse_loss, repeats=1)
    assert prediction.contention >= 1.0 and prediction.step_time_s > 0


def bn_dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Tanh())
            for _ in range(4)
        ]
    )


@pytest.mark.parametrize("deferred", [True, False])
def test_predict_profiles_batchnorm_as_trained_and_leaves_no_trace(deferred: bool) -> None:
    # the profile runs BatchNorm accumulating and dropout hooked, as the executor does: a step
    # after predict must equal one without it (gradients, running statistics, RNG)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    pipes = [
        GPipe(
            bn_dropout_model(),
            [2, 2],
            devices=["cpu"] * 2,
            chunks=4,
            checkpoint="except_last",
            deferred_batch_norm=deferred,
        )
        for _ in range(2)
    ]
    results = []
    for i, pipe in enumerate(pipes):
        torch.manual_seed(1)
        if i == 1:
            predict(pipe, x, y, nn.functional.mse_loss, repeats=1)
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        results.append((loss, [p.grad for p in pipe.parameters()], list(pipe.buffers())))
        results[-1][2].append(torch.get_rng_state())
    (loss_a, grads_a, bufs_a), (loss_b, grads_b, bufs_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert all(torch.equal(a, b) for a, b in zip(bufs_a, bufs_b))


class PublicOnly:
    """A pipe as predict may read it: its public members only (no ``_worker_pool``, no
    ``_step_config``)."""

    def __init__(self, pipe: GPipe) -> None:
        self.partitions, self.devices, self.spec = pipe.partitions, pipe.devices, pipe.spec
        self.worker_pool, self.step_config = pipe.worker_pool, pipe.step_config


def test_predict_reads_a_pipe_through_its_public_members_only() -> None:
    pipe = GPipe(mlp(), [4, 4], devices=["cpu"] * 2, chunks=4, schedule="1f1b")
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    seen = predict(PublicOnly(pipe), x, y, nn.functional.mse_loss, repeats=1)
    direct = predict(pipe, x, y, nn.functional.mse_loss, repeats=1)
    assert seen.peak_memory_bytes == direct.peak_memory_bytes
    assert seen.simulation.peak_activation_bytes == direct.simulation.peak_activation_bytes
