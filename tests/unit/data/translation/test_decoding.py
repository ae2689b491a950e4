"""Decoding (greedy, beam) on the flat encoder-decoder: valid sequences, modes restored, a beam
of one is greedy, stopping at </s>."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from giantpipe.data.translation.decoding import beam_search, greedy_decode
from models.transformer import transformer_t

torch.set_num_threads(1)


VOCAB, BOS, EOS, PAD = 30, 2, 3, 0


def tiny_model(seed: int = 0, vocab: int = VOCAB) -> nn.Sequential:
    torch.manual_seed(seed)
    return transformer_t(
        1, 32, 2, d_model=16, head_dim=8, vocab_size=vocab, max_len=32, dropout=0.1
    ).eval()


def sources() -> torch.Tensor:
    src = torch.randint(4, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
    src[1, 3:] = PAD
    return src


def assert_valid(hyps: list[list[int]], rows: int, max_len: int) -> None:
    assert len(hyps) == rows
    for ids in hyps:
        assert len(ids) <= max_len
        assert all(isinstance(i, int) and 0 <= i < VOCAB for i in ids)
        assert not {PAD, BOS, EOS} & set(ids)


def test_greedy_decoding_gives_valid_sequences() -> None:
    model = tiny_model()
    hyps = greedy_decode(model, sources(), max_len=9)
    assert_valid(hyps, 4, 9)
    assert greedy_decode(model, sources(), max_len=9) == hyps  # eval mode: deterministic


def test_beam_search_gives_valid_sequences_and_restores_mode() -> None:
    model = tiny_model().train()
    hyps = beam_search(model, sources(), beam_size=3, max_len=9)
    assert_valid(hyps, 4, 9)
    assert model.training


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_of_one_equals_greedy(seed: int) -> None:
    model = tiny_model(seed)
    assert beam_search(model, sources(), beam_size=1, max_len=9) == greedy_decode(
        model, sources(), max_len=9
    )


def test_decoding_stops_at_eos() -> None:
    model = tiny_model()
    with torch.no_grad():  # make </s> the only likely token
        model[-1].proj.weight.zero_()
        model[-1].proj.weight[EOS] = 1.0
        model[-1].norm.bias.fill_(1.0)
    assert greedy_decode(model, sources()) == [[]] * 4
    assert beam_search(model, sources(), beam_size=2) == [[]] * 4
