"""Transformer builders: parameter counts vs the paper, tuple boundaries, masks, stabilizers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.transformer import (
    DecoderLayer,
    EncoderLayer,
    label_smoothed_cross_entropy,
    split_points,
    tied_parameter_layers,
    transformer_lm,
    transformer_t,
)
from models.transformer import count_parameters as count

torch.set_num_threads(1)

VOCAB = 40


def tiny(**kwargs) -> nn.Sequential:
    torch.manual_seed(0)
    options = dict(d_model=32, head_dim=8, vocab_size=VOCAB, max_len=64, dropout=0.0)
    options.update(kwargs)
    return transformer_t(2, 48, 4, **options)


def sample_batch(batch: int = 3, src_len: int = 7, tgt_len: int = 5):
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, VOCAB, (batch, src_len), generator=gen)
    tgt = torch.randint(4, VOCAB, (batch, tgt_len), generator=gen)
    src[0, src_len - 2 :] = 0  # right padding
    tgt[1, tgt_len - 2 :] = 0
    return src, tgt


@pytest.mark.parametrize("layers, paper", [(3, 282.2e6), (13, 785.8e6), (103, 5.3e9)])
def test_transformer_lm_parameter_count_follows_table_1(layers: int, paper: float) -> None:
    with torch.device("meta"):
        model = transformer_lm(layers)
    assert count(model) == 50_358_272 * layers + 131_072_000
    assert abs(count(model) / paper - 1) < 0.005  # the paper rounds to 0.1M / 0.1B
    assert len(model) == layers + 2


# T(L, H, A), 64,000-token vocabulary, source/target embedding shared, softmax untied.
T_COUNTS = [
    ((6, 8192, 16), 408_145_920, 0.4e9),
    ((24, 8192, 16), 1_239_355_392, 1.3e9),
    ((12, 16384, 32), 1_239_171_072, 1.3e9),
    ((32, 16384, 32), 3_085_996_032, 3.0e9),
    ((64, 16384, 32), 6_040_915_968, 6.0e9),
]


@pytest.mark.parametrize("sizes, expected, paper", T_COUNTS)
def test_transformer_t_parameter_counts(sizes: tuple, expected: int, paper: float) -> None:
    with torch.device("meta"):
        model = transformer_t(*sizes, vocab_size=64000)
    assert count(model) == expected
    assert abs(expected / paper - 1) < 0.05  # within 5% of the paper's rounded sizes
    assert len(model) == 2 * sizes[0] + 2


def test_tied_softmax_saves_one_table_and_is_reported() -> None:
    with torch.device("meta"):
        tied = transformer_t(6, 8192, 16, vocab_size=64000, tie_embeddings=True)
    assert count(tied) == 408_145_920 - 64000 * 1024
    assert tied_parameter_layers(tied) == [{0, 13}]
    assert tied_parameter_layers(tiny()) == []
    assert tied_parameter_layers(transformer_lm(1, d_model=16, ffn_dim=32, num_heads=2)) == []


def test_every_child_boundary_is_a_tuple_with_bool_masks() -> None:
    model = tiny(dropout=0.1)
    state = sample_batch()
    for index, child in enumerate(model):
        state = child(state)
        if index == len(model) - 1:
            assert state.shape == (3, 5, VOCAB)
            continue
        assert isinstance(state, tuple) and len(state) == 4
        src_x, src_pad, tgt_x, tgt_pad = state
        assert src_x.dtype == tgt_x.dtype == torch.float32
        assert src_pad.dtype == tgt_pad.dtype == torch.bool
        assert not src_pad.requires_grad and not tgt_pad.requires_grad
        assert src_x.shape == (3, 7, 32) and tgt_x.shape == (3, 5, 32)


@pytest.mark.parametrize("cut", range(1, 6))
def test_any_cut_gives_the_same_output(cut: int) -> None:
    model = tiny().eval()
    batch = sample_batch()
    torch.testing.assert_close(model[cut:](model[:cut](batch)), model(batch))


def test_logits_are_finite_and_causal() -> None:
    model = tiny().eval()
    src, tgt = sample_batch()
    logits = model((src, tgt))
    assert torch.isfinite(logits).all()
    changed = tgt.clone()
    changed[:, -1] = 5
    torch.testing.assert_close(model((src, changed))[:, :-1], logits[:, :-1])


def test_source_padding_does_not_change_logits() -> None:
    model = tiny().eval()
    src, tgt = sample_batch()
    padded = torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model((padded, tgt)), model((src, tgt)))


def test_encode_and_decode_logits_match_the_full_forward() -> None:
    model = tiny().eval()
    src, tgt = sample_batch()
    first, head = split_points(model)
    assert isinstance(model[first], DecoderLayer) and isinstance(model[first - 1], EncoderLayer)
    assert head == len(model) - 1
    src_x, src_pad = model.encode(src)
    torch.testing.assert_close(model.decode_logits(src_x, src_pad, tgt), model((src, tgt)))


@pytest.mark.parametrize("mode", ["tanh", "clamp"])
def test_logit_clipping_bounds_the_logits(mode: str) -> None:
    src, tgt = sample_batch()
    free, clipped = tiny(), tiny(logit_clip=3.0, logit_clip_mode=mode)
    for model in (free, clipped):
        with torch.no_grad():
            model[-1].proj.weight.mul_(50.0)
    assert free((src, tgt)).abs().max() > 3.0
    assert clipped((src, tgt)).abs().max() <= 3.0
    with pytest.raises(ValueError, match="logit_clip_mode"):
        tiny(logit_clip=3.0, logit_clip_mode="soft")


@pytest.mark.parametrize("scale, factor", [("sqrt", 0.5), ("linear", 0.5), (0.25, 0.25)])
def test_ffn_init_scale_shrinks_only_feed_forward_weights(scale, factor: float) -> None:
    base, scaled = tiny(), tiny(ffn_init_scale=scale)  # L = 2: 1/sqrt(2L) = 1/L = 0.5
    for (name, p), q in zip(base.named_parameters(), scaled.parameters(), strict=True):
        is_ffn_weight = ".ffn.fc" in name and name.endswith("weight")
        torch.testing.assert_close(q, p * factor if is_ffn_weight else p)


def test_dropout_uses_dropout_modules() -> None:
    model = tiny(dropout=0.3, attn_dropout=0.1)
    names = {type(m).__name__ for m in model.modules()}
    assert "Dropout" in names
    batch = sample_batch()
    model.train()
    assert not torch.equal(model(batch), model(batch))
    model.eval()
    assert torch.equal(model(batch), model(batch))


def test_transformer_lm_shapes_and_causality() -> None:
    torch.manual_seed(0)
    model = transformer_lm(2, d_model=32, ffn_dim=64, num_heads=4, vocab_size=50, max_len=16)
    tokens = torch.randint(0, 50, (2, 10))
    logits = model(tokens)
    assert logits.shape == (2, 10, 50) and torch.isfinite(logits).all()
    changed = tokens.clone()
    changed[:, -1] = 7
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])


def test_label_smoothed_cross_entropy_sums_non_pad_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, VOCAB, generator=gen)
    target = torch.tensor([[5, 6, 3, 0], [7, 3, 0, 0]])
    total, ntokens = label_smoothed_cross_entropy(logits, target, epsilon=0.0)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=0)
    assert int(ntokens) == 5
    torch.testing.assert_close(total, expected * 5)
    smoothed, _ = label_smoothed_cross_entropy(logits, target, epsilon=0.1)
    reference = F.cross_entropy(
        logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=0, label_smoothing=0.1
    )
    torch.testing.assert_close(smoothed, reference * 5)
