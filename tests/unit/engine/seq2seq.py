"""The translation model the generation tests decode with, and its plain decodings to compare a
pipe's against."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from giantpipe.data.translation.decoding import _max_steps, beam_search, greedy_decode
from models.transformer import transformer_t

BOS, EOS, PAD = 2, 3, 0


def seq2seq() -> nn.Sequential:
    """A 2-layer translation transformer (vocabulary 37), seeded, in eval mode."""
    torch.manual_seed(1)
    model = transformer_t(2, 48, 4, d_model=32, head_dim=8, vocab_size=37, max_len=48, dropout=0.0)
    return model.eval()


def translation_reference() -> dict[str, Any]:
    """Seven padded sources, their step limit, and the plain model's greedy and beam decodings."""
    model = seq2seq()
    torch.manual_seed(7)
    src = torch.randint(4, 37, (7, 6))
    src[3, 4:] = PAD
    return {
        "src": src,
        "steps": _max_steps(model, src, None),  # type: ignore[arg-type]
        "greedy": greedy_decode(model, src),
        "beam": beam_search(model, src, beam_size=3, length_penalty=0.6),
    }
