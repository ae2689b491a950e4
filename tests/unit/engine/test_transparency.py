"""A pipelined step equals the un-pipelined one: loss, every gradient, BatchNorm statistics.

The reference is the plain model run micro-batch by micro-batch (BatchNorm normalises per
micro-batch in both), with dropout seeded as the engine seeds it (see giantpipe.engine.rng).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.spec import SpecError
from giantpipe.perf.balance import solve_balance
from giantpipe.testing import reference_step, step_seed
from tests.unit.engine.engine_helpers import tuple_batch, tuple_model

MODES = ["always", "except_last", "never"]


def assert_same_grads(pipe: nn.Module, plain: nn.Module) -> None:
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
@pytest.mark.parametrize("mode", MODES)
def test_step_api_matches_plain_model(stages: int, chunks: int, mode: str) -> None:
    model = tuple_model()
    inputs, target = tuple_batch()
    balance = solve_balance([1.0] * len(model), stages)
    plain, ref_loss = reference_step(model, inputs, target, chunks, step_seed(5))

    pipe = GPipe(
        copy.deepcopy(model), balance, devices=["cpu"] * stages, chunks=chunks, checkpoint=mode
    )
    torch.manual_seed(5)
    loss = pipe.train_step(inputs, target, nn.functional.cross_entropy)

    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert_same_grads(pipe, plain)
    for (name, b), (_, c) in zip(pipe.named_buffers(), plain.named_buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
@pytest.mark.parametrize("mode", MODES)
def test_autograd_door_matches_plain_model(stages: int, chunks: int, mode: str) -> None:
    model = tuple_model()
    inputs, target = tuple_batch()
    balance = solve_balance([1.0] * len(model), stages)
    plain, ref_loss = reference_step(model, inputs, target, chunks, step_seed(9))

    pipe = GPipe(
        copy.deepcopy(model), balance, devices=["cpu"] * stages, chunks=chunks, checkpoint=mode
    )
    torch.manual_seed(9)
    loss = nn.functional.cross_entropy(pipe(inputs), target)
    loss.backward()

    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert_same_grads(pipe, plain)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("chunks", [2, 3, 4, 5])
def test_no_grad_forward_equals_the_plain_model_sample_by_sample(stages: int, chunks: int) -> None:
    """The evaluation path: ``pipe(x)`` under no_grad, M > 1 with uneven micro-batches (14
    samples: 7+7, 5+5+4, 4+4+3+3, 3+3+3+3+2), every output row the plain model's for the same
    sample, in the same order; the int mask rides along in order too."""
    model = tuple_model()
    with torch.no_grad():  # distinct running statistics per feature, so BatchNorm matters
        for layer in model[1:-1]:
            layer.bn.running_mean.uniform_(-0.5, 0.5)
            layer.bn.running_var.uniform_(0.5, 2.0)
    model.eval()
    (x, mask), _ = tuple_batch()
    with torch.no_grad():
        expected = model((x, mask))
        hidden, carried = model[:-1]((x, mask))
    pipe = GPipe(
        copy.deepcopy(model),
        solve_balance([1.0] * len(model), stages),
        devices=["cpu"] * stages,
        chunks=chunks,
    )
    pipe.eval()
    with torch.no_grad():
        out = pipe((x, mask))
    assert out.shape == expected.shape and not out.requires_grad
    for i in range(x.shape[0]):
        torch.testing.assert_close(out[i], expected[i], rtol=1e-5, atol=1e-6, msg=f"sample {i}")

    # A tuple output (the body without the head): every item gathered in micro-batch order.
    body = GPipe(
        copy.deepcopy(model[:-1]),
        solve_balance([1.0] * (len(model) - 1), stages),
        devices=["cpu"] * stages,
        chunks=chunks,
    )
    body.eval()
    with torch.no_grad():
        got_hidden, got_mask = body((x, mask))
    torch.testing.assert_close(got_hidden, hidden, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_mask, carried)


def test_input_gradient_flows_through_the_autograd_door() -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    x = torch.randn(6, 5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    copy.deepcopy(model)(x_ref).square().sum().backward()
    pipe = GPipe(copy.deepcopy(model), [1, 2], devices=["cpu", "cpu"], chunks=3)
    pipe(x).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_token_normalised_loss_matches_plain_model() -> None:
    """With loss_normalizer, micro-batch SUMS divided by one global count equal the plain mean."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 11))
    tokens = torch.randint(1, 11, (9, 5))
    tokens[:, 3:] = 0  # padding
    tokens[0, 3:] = 4
    target = tokens.roll(-1, dims=1)

    def loss_sum(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits.flatten(0, 1), tgt.flatten(), ignore_index=0, reduction="sum"
        )

    plain = copy.deepcopy(model)
    nn.functional.cross_entropy(
        plain(tokens).flatten(0, 1), target.flatten(), ignore_index=0
    ).backward()
    pipe = GPipe(copy.deepcopy(model), [2, 2], devices=["cpu", "cpu"], chunks=3)
    pipe.train_step(tokens, target, loss_sum, loss_normalizer=lambda t: int((t != 0).sum()))
    assert_same_grads(pipe, plain)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.3, None])
def test_deferred_batch_norm_tracks_whole_minibatch_statistics(mode: str, momentum) -> None:
    # BatchNorm comes first, so its input is the same in both runs (a later BatchNorm would see
    # activations normalised per micro-batch in one run and per mini-batch in the other).
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, momentum=momentum),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.Flatten(),
        nn.Linear(64, 2),
    )
    x = torch.randn(10, 3, 8, 8) * 3 + 1
    plain = copy.deepcopy(model)
    pipe = GPipe(
        copy.deepcopy(model),
        [2, 4],
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint=mode,
        deferred_batch_norm=True,
    )
    for _ in range(3):
        plain(x).sum().backward()  # the whole mini-batch at once
        pipe(x).sum().backward()
    for (name, b), (_, c) in zip(pipe.named_buffers(), plain.named_buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)
    assert int(pipe[1].num_batches_tracked) == 3


def test_plain_batch_norm_is_not_updated_twice_by_recompute() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))
    x = torch.randn(8, 4)
    stats = []
    for mode in ["never", "always"]:
        pipe = GPipe(
            copy.deepcopy(model), [2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=mode
        )
        pipe(x).sum().backward()
        stats.append((pipe[1].running_mean.clone(), int(pipe[1].num_batches_tracked)))
    torch.testing.assert_close(stats[0][0], stats[1][0])
    assert stats[0][1] == stats[1][1] == 2  # once per micro-batch, never for the recompute


@pytest.mark.parametrize(
    ("schedule", "virtual_stages"),
    [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb-v", 2)],
)
@pytest.mark.parametrize("batch", [0, 1, 3, 5])
def test_no_grad_forward_takes_a_batch_smaller_than_m(
    schedule: str, virtual_stages: int | None, batch: int
) -> None:
    """A short evaluation batch (the last of a set whose size is no multiple of the batch)
    at M=4: min(M, batch) micro-batches (one empty one for an empty batch), outputs the plain
    model's in eval mode, with virtual stages too; M itself stays 4 for training."""
    model = tuple_model()
    with torch.no_grad():  # distinct running statistics per feature, so BatchNorm matters
        for layer in model[1:-1]:
            layer.bn.running_mean.uniform_(-0.5, 0.5)
            layer.bn.running_var.uniform_(0.5, 2.0)
    model.eval()
    (x, mask), target = tuple_batch()
    x, mask, target = x[:batch], mask[:batch], target[:batch]
    stages = 2 * (virtual_stages or 1)
    pipe = GPipe(
        copy.deepcopy(model),
        solve_balance([1.0] * len(model), stages),
        devices=["cpu", "cpu"],
        chunks=4,
        schedule=schedule,
        virtual_stages=virtual_stages,
    )
    pipe.eval()
    with torch.no_grad():
        expected = model((x, mask))
        out = pipe((x, mask))
    assert out.shape == expected.shape == (batch, 3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert pipe.last_stats is not None and pipe.last_stats.chunks == max(1, min(4, batch))
    assert pipe.chunks == 4 and pipe.spec.chunks == 4
    if batch >= 4:
        return
    pipe.train()  # training keeps M: a smaller batch is refused, naming the key to change
    with pytest.raises(
        SpecError,
        match=rf"pipeline\.chunks: chunks \(4\) is larger than the batch size \({batch}\)",
    ):
        pipe.train_step((x, mask), target, nn.functional.cross_entropy)
    with pytest.raises(SpecError, match=r"pipeline\.chunks"):
        pipe((x, mask))  # the autograd door trains too
