"""Gradient accumulation: A engine steps give the gradients of one batch of all A."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from giantpipe.engine import GPipe
from giantpipe.runner.losses import build_loss
from giantpipe.runner.step import accumulate_gradients


def grads_after(batches, loss_fn, normalizer, chunks: int = 2) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))
    pipe = GPipe(net, [2, 3], devices=["cpu", "cpu"], chunks=chunks)
    loss, stats = accumulate_gradients(pipe, batches, loss_fn, normalizer, "fp32", ["cpu", "cpu"])
    assert len(stats) == len(batches)
    return loss, [p.grad.clone() for p in pipe.parameters()]


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 5, (n,), generator=g)


def test_mean_loss_accumulation_equals_the_combined_batch_even_when_uneven():
    (x1, y1), (x2, y2) = data(8, 1), data(4, 2)  # uneven sizes: weights 8/12 and 4/12
    loss_fn = build_loss("cross_entropy", 0.0, None, summed=False)
    big_loss, big = grads_after([(torch.cat([x1, x2]), torch.cat([y1, y2]))], loss_fn, None)
    acc_loss, acc = grads_after([(x1, y1), (x2, y2)], loss_fn, None)
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)
    for a, b in zip(acc, big, strict=True):
        torch.testing.assert_close(a, b)


def test_normalized_loss_accumulation_divides_by_the_combined_count():
    pad = 0
    (x1, y1), (x2, y2) = data(8, 3), data(8, 4)
    y1[:3] = pad  # some "padding" targets, left out of the loss and the count

    def tokens(t: torch.Tensor) -> float:
        return float((t != pad).sum())

    loss_fn = build_loss("cross_entropy", 0.0, pad, summed=True)
    big_loss, big = grads_after([(torch.cat([x1, x2]), torch.cat([y1, y2]))], loss_fn, tokens)
    acc_loss, acc = grads_after([(x1, y1), (x2, y2)], loss_fn, tokens)
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)
    for a, b in zip(acc, big, strict=True):
        torch.testing.assert_close(a, b)
    # ...and both equal the plain model's mean over the real tokens.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))
    x, y = torch.cat([x1, x2]), torch.cat([y1, y2])
    F.cross_entropy(net(x), y, ignore_index=pad).backward()
    for a, p in zip(acc, net.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)
