"""The paper's models through the engine: pipelined gradients equal the plain model's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.rng import install_rng_hooks
from giantpipe.testing import accumulate_micro_batches, reference_step, step_seed
from models.amoebanet import amoebanetd
from models.transformer import label_smoothed_cross_entropy, transformer_t

pytestmark = pytest.mark.slow  # the paper's models trained pipelined against plain


def assert_same_grads(pipe: nn.Module, plain: nn.Module, atol: float = 1e-6) -> None:
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=atol, msg=name)


def test_amoebanet_k3_m4_always_deferred_batch_norm_matches_plain() -> None:
    torch.manual_seed(0)
    model = amoebanetd(num_layers=3, num_filters=8, num_classes=5, image_size=64)
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 5, (16,))
    # Deep BatchNorm stacks amplify float rounding: the plain model alone differs by 3e-4 in
    # some gradients between 1 and 2 intra-op threads. Each pipeline worker uses one thread on
    # this machine, so the reference does too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, ref_loss = reference_step(model, x, y, chunks=4, seed=step_seed(3))
    finally:
        torch.set_num_threads(threads)

    pipe = GPipe(
        copy.deepcopy(model),
        [3, 3, 3],
        devices=["cpu"] * 3,
        chunks=4,
        recompute="always",
        deferred_batch_norm=True,
        threads_per_worker=1,
    )
    torch.manual_seed(3)
    loss = pipe.train_step(x, y, nn.functional.cross_entropy)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert_same_grads(pipe, plain, atol=1e-5)

    # Deferred batch norm: running statistics of the whole mini-batch, as the plain model on it.
    # The stem's BatchNorm sees the same input in both runs, so its statistics must agree.
    whole = copy.deepcopy(model)
    whole(x)
    stem_bn = [m for m in pipe[0].modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    whole_bn = [m for m in whole[0].modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for a, b in zip(stem_bn, whole_bn):
        torch.testing.assert_close(a.running_mean, b.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.running_var, b.running_var, rtol=1e-5, atol=1e-6)


def padded_batch(n: int, vocab: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src_len, tgt_len = 5 + seed % 3, 4 + seed % 4  # lengths change from batch to batch
    src = torch.randint(3, vocab, (n, src_len), generator=g)
    tgt = torch.randint(3, vocab, (n, tgt_len + 1), generator=g)
    for i in range(n):  # ragged sentences, padded with 0
        src[i, torch.randint(2, src_len + 1, (1,), generator=g).item() :] = 0
        tgt[i, torch.randint(2, tgt_len + 2, (1,), generator=g).item() :] = 0
    return (src, tgt[:, :-1]), tgt[:, 1:]


@pytest.mark.parametrize("mode", ["always", "never"])
def test_transformer_k3_m4_dropout_variable_lengths_matches_plain(mode: str) -> None:
    torch.manual_seed(0)
    vocab = 40
    model = transformer_t(
        2, 32, 2, d_model=16, head_dim=8, vocab_size=vocab, dropout=0.2, max_len=32
    )
    pipe = GPipe(copy.deepcopy(model), [2, 2, 2], devices=["cpu"] * 3, chunks=4, recompute=mode)
    plain = copy.deepcopy(model)

    def loss_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return label_smoothed_cross_entropy(logits, target, epsilon=0.1)[0]

    def tokens(target: torch.Tensor) -> int:
        return int(target.ne(0).sum())

    for step in range(3):  # shapes change between steps
        inputs, target = padded_batch(8, vocab, seed=step)
        seed = step_seed(100 + step)
        ref = 0.0
        handles = install_rng_hooks(plain)
        for part in accumulate_micro_batches(plain, inputs, target, 4, seed, loss_sum, tokens):
            ref += part.item()
        for h in handles:
            h.remove()
        torch.manual_seed(100 + step)
        loss = pipe.train_step(inputs, target, loss_sum, loss_normalizer=tokens)
        assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert_same_grads(pipe, plain)
