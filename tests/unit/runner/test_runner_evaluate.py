"""Evaluation: the loss is a mean over samples (or real tokens), however the batches fall."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from giantpipe.data.bundle import DataBundle
from giantpipe.engine import GPipe
from giantpipe.runner.evaluate import evaluate


def bundle_of(batches: list, **kwargs) -> DataBundle:
    return DataBundle(
        train_batches=lambda seed, position: iter(batches),
        eval_batches=lambda: batches,
        batches_per_epoch=1,
        **kwargs,
    )


@pytest.mark.parametrize("chunks", [1, 2])
def test_eval_loss_is_the_mean_over_samples_when_the_last_batch_is_short(chunks: int) -> None:
    """Ten samples in batches of 4, 4 and 2; the model outputs 0, so a sample's squared error
    is its target squared: the mean over samples is (1 + 4 + ... + 100) / 10 = 38.5 exactly,
    where a mean of the three batch means would give (7.5 + 43.5 + 90.5) / 3 = 47.17."""
    model = nn.Sequential(nn.Linear(3, 1), nn.Identity())
    nn.init.zeros_(model[0].weight)
    nn.init.zeros_(model[0].bias)
    pipe = GPipe(model, [1, 1], devices=["cpu", "cpu"], chunks=chunks)
    x = torch.randn(10, 3)
    y = torch.arange(1.0, 11.0).unsqueeze(1)
    batches = [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])]
    figures = evaluate(pipe, bundle_of(batches, loss="mse", metric=None), None, "fp32", ["cpu"])
    assert figures == {"loss": 38.5}
    assert pipe.training  # evaluation puts the mode back


def test_eval_loss_and_accuracy_are_means_over_real_tokens() -> None:
    """Token-level loss (summed, divided by the real tokens): batches with different numbers
    of real tokens weigh by their tokens; the result equals the plain model's mean over all."""
    torch.manual_seed(0)
    pad, vocab = 0, 5
    model = nn.Sequential(nn.Embedding(vocab, 8), nn.Tanh(), nn.Linear(8, vocab))
    tokens = torch.randint(1, vocab, (7, 6))
    targets = torch.randint(1, vocab, (7, 6))
    targets[0, 1:] = pad  # the first batch holds few real tokens, the short last batch many
    targets[1, 2:] = pad
    targets[2, 3:] = pad
    batches = [(tokens[:3], targets[:3]), (tokens[3:6], targets[3:6]), (tokens[6:], targets[6:])]
    with torch.no_grad():
        logits = model(tokens)
    expected_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad)
    real = targets != pad
    expected_accuracy = int(((logits.argmax(-1) == targets) & real).sum()) / int(real.sum())
    bundle = bundle_of(
        batches,
        loss="cross_entropy",
        metric="accuracy",
        ignore_index=pad,
        loss_normalizer=lambda t: float((t != pad).sum()),
    )
    pipe = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=1)
    figures = evaluate(pipe, bundle, None, "fp32", ["cpu"])
    assert figures["loss"] == pytest.approx(float(expected_loss), rel=1e-6)
    assert figures["accuracy"] == expected_accuracy


class ReplicaOne(nn.Module):
    """Replica 1 of 2 (as a DistributedPipe reports it), with a local pipe behind it."""

    replica, replicas = 1, 2

    def __init__(self, pipe: GPipe) -> None:
        super().__init__()
        self.pipe = pipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pipe(x)


def test_a_last_batch_smaller_than_m_is_evaluated_and_an_empty_share_counts_nothing() -> None:
    """513 = 8 x 64 + 1 in small: nine samples in batches of 4, 4 and 1 at M=4. The last batch
    runs in one micro-batch and the loss is the mean over all nine samples, the plain model's.
    Replica 1 of 2 gets an empty share of that last batch, which adds nothing (not a NaN)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(9, 3), torch.randn(9, 2)
    batches = [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])]
    bundle = bundle_of(batches, loss="mse", metric=None)
    with torch.no_grad():
        plain = F.mse_loss(model(x), y, reduction="none").mean(1)
    pipe = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=4)
    figures = evaluate(pipe, bundle, None, "fp32", ["cpu"])
    assert figures["loss"] == pytest.approx(float(plain.mean()), rel=1e-6)
    share = evaluate(ReplicaOne(pipe), bundle, None, "fp32", ["cpu"])  # rows 2, 3, 6, 7; none of 8
    assert share["loss"] == pytest.approx(float(plain[[2, 3, 6, 7]].mean()), rel=1e-6)


def test_evaluation_leaves_each_module_in_the_mode_it_found() -> None:
    """A module the user froze in eval mode (a BatchNorm kept fixed while fine-tuning) stays in
    eval mode after the run's evaluation; the rest train again."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    pipe = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    pipe.train()
    model[1].eval()
    batches = [(torch.randn(4, 3), torch.randn(4, 1))]
    evaluate(pipe, bundle_of(batches, loss="mse", metric=None), None, "fp32", ["cpu"])
    assert pipe.training and model[0].training and model[2].training
    assert not model[1].training
