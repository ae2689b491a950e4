"""Transformer-L of the paper's Table 1: a decoder-only stack as one flat ``nn.Sequential``.

``transformer_lm(L)`` = [LMEmbedding, L DecoderOnlyLayer, OutputHead]; tensors [B, T, D] between
children, int64 tokens in, logits out. With the default sizes (model dim 2048, FFN 8192, 32 heads,
32k vocabulary, untied softmax) the parameters are 50,358,272 L + 131,072,000 exactly.

Example::

    with torch.device("meta"):
        model = transformer_lm(48)               # Transformer-48 of Table 2
    count_parameters(model)                      # 2,548,269,056
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from models.transformer_layers import (
    KVCache,
    OutputHead,
    Seen,
    SeenRows,
    SelfAttentionLayer,
    ffn_factor,
    init_weights,
    layer_init,
    sinusoidal_positions,
)

__all__ = ["DecoderOnlyLayer", "LMEmbedding", "transformer_lm"]


class DecoderOnlyLayer(SelfAttentionLayer):
    """Causal self-attention layer of Transformer-L: tensor [B, T, D] in and out."""

    def forward(self, x: Tensor) -> Tensor:
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        return self.block(x, causal[None, None])

    def forward_cached(
        self, x: Tensor | tuple[Tensor, Tensor], cache: KVCache | None
    ) -> tuple[Tensor | tuple[Tensor, Tensor], KVCache]:
        """Incremental decoding: states of the new positions ``x`` [B, t, D] given the keys and
        values of the earlier ones (None: the prompt); equals ``forward`` on the whole prefix.
        A padded prompt comes as ``(x, keep)`` and goes on as ``(y, keep)``; its cache keeps
        ``keep`` (``models.transformer_layers``).

        Example::

            y, cache = layer.forward_cached(x[:, :-1], None)
            last, cache = layer.forward_cached(x[:, -1:], cache)   # == layer(x)[:, -1:]
        """
        if isinstance(x, tuple):
            states, keep = x
            y, kv = self.causal_block_cached(states, cache, keep)
            return (y, keep), kv
        return self.causal_block_cached(x, cache)


class LMEmbedding(nn.Module):
    """Child 0 of Transformer-L: tokens [B, T] -> states [B, T, D] (sinusoidal positions)."""

    positions: Tensor

    def __init__(self, vocab_size: int, d_model: int, max_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.scale = math.sqrt(d_model)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embed(tokens, 0)

    def embed(self, tokens: Tensor, start: int) -> Tensor:
        """States of ``tokens`` [B, t] at positions start .. start + t - 1."""
        end = start + tokens.shape[1]
        if end > self.positions.shape[0]:
            raise ValueError(f"position {end - 1} is past model.max_len={self.positions.shape[0]}")
        x = self.tokens(tokens) * self.scale + self.positions[start:end]
        return self.dropout(x)

    def forward_cached(
        self, tokens: Tensor | tuple[Tensor, Tensor], cache: Seen | SeenRows | None
    ) -> tuple[Tensor | tuple[Tensor, Tensor], Seen | SeenRows]:
        """Incremental decoding: the new tokens [B, t] after the ``cache.length`` seen. A padded
        prompt, ``(tokens, keep)``, places each row's first token at position 0 and goes on as
        ``(states, keep)``; the cache then keeps each row's next position."""
        if isinstance(tokens, tuple):  # the prompts, left-padded (keep: their tokens)
            ids, keep = tokens
            positions = (keep.long().cumsum(dim=1) - 1).clamp(min=0)
            return (self._at(ids, positions), keep), SeenRows(keep.long().sum(dim=1))
        if isinstance(cache, SeenRows):
            steps = torch.arange(tokens.shape[1], device=tokens.device)
            positions = cache.next.to(tokens.device)[:, None] + steps
            return self._at(tokens, positions), SeenRows(cache.next + tokens.shape[1])
        start = 0 if cache is None else cache.length
        return self.embed(tokens, start), Seen(start + tokens.shape[1])

    def _at(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """States of ``tokens`` [B, t] at per-row ``positions`` [B, t]."""
        if int(positions.max()) >= self.positions.shape[0]:
            last = int(positions.max())
            raise ValueError(f"position {last} is past model.max_len={self.positions.shape[0]}")
        x = self.tokens(tokens) * self.scale + self.positions[positions]
        return self.dropout(x)


def transformer_lm(
    num_layers: int,
    *,
    d_model: int = 2048,
    ffn_dim: int = 8192,
    num_heads: int = 32,
    vocab_size: int = 32000,
    max_len: int = 1024,
    dropout: float = 0.0,
    attn_dropout: float = 0.0,
    ffn_init_scale: float | str | None = None,
    logit_clip: float | None = None,
    logit_clip_mode: str = "tanh",
) -> nn.Sequential:
    """Transformer-L of Table 1: [LMEmbedding, L causal layers, LMHead], untied embedding/softmax.

    Sinusoidal positions and a parameter-free final LayerNorm keep the count at exactly
    50,358,272 L + 131,072,000 for the default sizes (282.2M at L=3, 5.3B at L=103).

    Example::

        with torch.device("meta"):
            model = transformer_lm(3)
        count_parameters(model) == 282_146_816
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    head_dim = d_model // num_heads
    layers = [
        DecoderOnlyLayer(d_model, ffn_dim, num_heads, head_dim, dropout, attn_dropout)
        for _ in range(num_layers)
    ]
    head = OutputHead(d_model, vocab_size, logit_clip, logit_clip_mode, norm_affine=False)
    model = nn.Sequential(LMEmbedding(vocab_size, d_model, max_len, dropout), *layers, head)
    factor = ffn_factor(ffn_init_scale, num_layers)
    init_weights(model, d_model, factor, pad_id=None)
    setattr(model, "giantpipe_init_layer", layer_init(d_model, factor, None))  # noqa: B010
    return model
