"""Incremental decoding of the project's Transformers: ``forward_cached`` fed one position at a
time equals the whole-prefix forward (the logits of every position), after beams are reordered
and with padding inside the target prefix; and cached decoding of the plain model gives the
uncached reference decoder's tokens (``giantpipe.data.translation.decoding``), greedy and beam,
fp32."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from giantpipe.data.translation.decoding import _max_steps, beam_search, greedy_decode
from giantpipe.engine.generate import Decoding, generate, split_rows
from models.transformer import transformer_lm, transformer_t

torch.set_num_threads(1)  # tiny ops: more threads only contend on a shared machine

BOS, EOS, PAD = 2, 3, 0


def seq2seq(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = transformer_t(2, 48, 4, d_model=32, head_dim=8, vocab_size=37, max_len=48, dropout=0.0)
    return model.eval()


def lm(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = transformer_lm(3, d_model=32, ffn_dim=48, num_heads=4, vocab_size=41, max_len=48)
    return model.eval()


def cached_logits(model: nn.Sequential, first: object, rest: Tensor) -> Tensor:
    """Logits of the last position after the prompt ``first`` and then each token of ``rest``
    alone, through every child's ``forward_cached``: [B, 1 + rest.shape[1], V]."""
    caches: list[object] = [None] * len(model)
    out = []
    value: object = first
    for step in range(rest.shape[1] + 1):
        for i, child in enumerate(model):
            value, caches[i] = child.forward_cached(value, caches[i])
        out.append(value[:, -1])
        if step < rest.shape[1]:
            value = rest[:, step : step + 1]
    return torch.stack(out, dim=1)


@torch.no_grad()
def test_lm_cached_positions_equal_the_whole_prefix() -> None:
    model = lm()
    tokens = torch.randint(0, 41, (3, 9))
    full = model(tokens)[:, 3:]
    assert torch.allclose(cached_logits(model, tokens[:, :4], tokens[:, 4:]), full, atol=1e-5)


@torch.no_grad()
def test_encoder_decoder_cached_positions_equal_the_whole_prefix_with_padding_inside() -> None:
    model = seq2seq()
    src = torch.randint(4, 37, (3, 6))
    src[0, 4:] = PAD
    prefix = torch.randint(4, 37, (3, 8))
    prefix[:, 0] = BOS
    prefix[1, 3] = PAD  # a generated pad token: the uncached decoder masks it as a key
    src_x, src_pad = model.encode(src)
    full = model.decode_logits(src_x, src_pad, prefix)
    cached = cached_logits(model, (src, prefix[:, :1]), prefix[:, 1:])
    assert torch.allclose(cached, full, atol=1e-5)


@torch.no_grad()
def test_reordered_caches_follow_their_rows() -> None:
    model = lm()
    tokens = torch.randint(0, 41, (3, 6))
    caches: list[object] = [None] * len(model)
    value: object = tokens[:, :5]
    for i, child in enumerate(model):
        value, caches[i] = child.forward_cached(value, caches[i])
    order = torch.tensor([2, 2, 0])  # two beams of row 2, one of row 0; row 1 finished
    caches = [None if c is None else c.reorder(order) for c in caches]
    value = tokens[order, 5:]
    for i, child in enumerate(model):
        value, caches[i] = child.forward_cached(value, caches[i])
    assert torch.allclose(value[:, -1], model(tokens[order])[:, -1], atol=1e-5)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_cached_decoding_of_the_plain_model_equals_the_uncached_reference(beam_size: int) -> None:
    model = seq2seq(seed=1)
    torch.manual_seed(7)
    src = torch.randint(4, 37, (6, 7))
    src[2, 5:] = PAD
    if beam_size == 1:
        reference = greedy_decode(model, src)
    else:
        reference = beam_search(model, src, beam_size=beam_size, length_penalty=0.6)
    steps = _max_steps(model, src, None)  # type: ignore[arg-type]
    prompts = [(s, torch.full((len(s), 1), BOS)) for s in split_rows(src, 2)]
    decoding = Decoding(beam_size=beam_size, length_penalty=0.6, eos_id=EOS, pad_id=PAD)
    out = generate(model, prompts, [steps] * 2, decoding)
    assert out[0] + out[1] == reference
    assert any(len(t) > 3 for t in reference)  # not a trivial comparison


def test_lm_greedy_cached_equals_the_uncached_loop() -> None:
    model = lm(seed=2)
    tokens = torch.randint(0, 41, (4, 5))
    with torch.no_grad():
        seq = tokens
        for _ in range(12):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    out = generate(model, [tokens], [12], Decoding())
    assert out[0] == seq[:, 5:].tolist()
