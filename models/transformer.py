"""The paper's T(L, H, A) encoder-decoder as one flat ``nn.Sequential`` (Section 5).

2L + 2 children (embedding, L encoder layers, L decoder layers, output head), every boundary
the 4-tuple ``(src_x, src_pad, tgt_x, tgt_pad)``; an :class:`EncoderDecoder` that also decodes
without the engine and offers ``forward_cached`` to the pipeline's generation
(docs/paper-tables.md#the-transformers). Transformer-L is ``models.transformer_lm``.

Example::

    model = transformer_t(2, 64, 4, d_model=32, head_dim=8, vocab_size=100, max_len=64)
    logits = model((src_tokens, tgt_in_tokens))                   # [B, T, 100]
    total, ntokens = label_smoothed_cross_entropy(logits, tgt_out_tokens)
    src_x, src_pad = model.encode(src_tokens)                     # once per batch, then per step:
    next_logits = model.decode_logits(src_x, src_pad, prefix)[:, -1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.transformer_layers import (
    FeedForward,
    KVCache,
    MultiHeadAttention,
    OutputHead,
    Seen,
    SelfAttentionLayer,
    allowed_keys,
    attention_mask,
    count_parameters,
    ffn_factor,
    init_weights,
    sinusoidal_positions,
)
from models.transformer_lm import transformer_lm

__all__ = [
    "EncoderDecoder",
    "DecoderCache",
    "transformer_t",
    "transformer_lm",
    "tied_parameter_layers",
    "split_points",
    "label_smoothed_cross_entropy",
    "count_parameters",
]

Batch4 = tuple[Tensor, Tensor, Tensor, Tensor]


class EncoderLayer(SelfAttentionLayer):
    """Encoder layer on the 4-tuple: updates the source states, carries the rest."""

    def forward(self, inputs: Batch4) -> Batch4:
        src_x, src_pad, tgt_x, tgt_pad = inputs
        return self.block(src_x, attention_mask(src_pad)), src_pad, tgt_x, tgt_pad

    def forward_cached(self, inputs: Batch4, cache: Seen | None) -> tuple[Batch4, Seen]:
        """Incremental decoding: encodes the source on the first call; later calls (an empty
        source, the new target positions) pass through."""
        if cache is not None:
            return inputs, cache
        return self(inputs), Seen(inputs[0].shape[1])


@dataclass
class DecoderCache:
    """A decoder layer's cache: its self-attention's keys and values (grown every step) with
    which of those positions are tokens (not padding), and the cross-attention's keys and
    values over the source (computed once) with the source's mask."""

    self_kv: KVCache
    tgt_keep: Tensor  # [B, T], False at target padding
    cross_kv: KVCache
    src_allowed: Tensor  # [B, 1, 1, S]

    def reorder(self, index: Tensor) -> DecoderCache:
        index = index.to(self.src_allowed.device)
        return DecoderCache(
            self.self_kv.reorder(index),
            self.tgt_keep.index_select(0, index),
            self.cross_kv.reorder(index),
            self.src_allowed.index_select(0, index),
        )


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer on the 4-tuple: causal self-attention, cross-attention, FFN.

    The first decoder layer owns the encoder's final LayerNorm (``memory_norm=True``) and passes
    the normalised source states on, so later layers attend to them directly.
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        num_heads: int,
        head_dim: int,
        dropout: float,
        attn_dropout: float,
        memory_norm: bool = False,
    ) -> None:
        super().__init__()
        self.memory_norm = nn.LayerNorm(d_model) if memory_norm else None
        self.self_attn_norm = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, num_heads, head_dim, attn_dropout)
        self.cross_attn_norm = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, head_dim, attn_dropout)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: Batch4) -> Batch4:
        src_x, src_pad, x, tgt_pad = inputs
        if self.memory_norm is not None:
            src_x = self.memory_norm(src_x)
        h = self.self_attn_norm(x)
        x = x + self.dropout(self.self_attn(h, h, attention_mask(tgt_pad, causal_len=x.shape[1])))
        h = self.cross_attn_norm(x)
        x = x + self.dropout(self.cross_attn(h, src_x, attention_mask(src_pad)))
        x = x + self.dropout(self.ffn(self.ffn_norm(x)))
        return src_x, src_pad, x, tgt_pad

    def forward_cached(
        self, inputs: Batch4, cache: DecoderCache | None
    ) -> tuple[Batch4, DecoderCache]:
        """Incremental decoding. The first call (``cache`` None) takes the 4-tuple with the
        encoded source and the target prefix, and keeps the source's keys and values; later
        calls take the new target positions only (the source may be empty: it is cached).
        Target padding is not masked here: decoding drops finished rows instead of padding them.

        Example::

            state, cache = layer.forward_cached((src_x, src_pad, prefix_x, prefix_pad), None)
            state, cache = layer.forward_cached((empty, empty_pad, new_x, new_pad), cache)
        """
        src_x, src_pad, x, tgt_pad = inputs
        if cache is None:
            if self.memory_norm is not None:
                src_x = self.memory_norm(src_x)
            cross_kv, src_allowed = self.cross_attn.keys_values(src_x), attention_mask(src_pad)
        else:
            cross_kv, src_allowed = cache.cross_kv, cache.src_allowed
        h = self.self_attn_norm(x)
        self_kv, keep = self.self_attn.keys_values(h), ~tgt_pad
        if cache is not None:
            self_kv = cache.self_kv.extend(self_kv.key, self_kv.value)
            keep = torch.cat([cache.tgt_keep, keep], dim=1)
        x = x + self.dropout(self.self_attn.attend(h, self_kv, allowed_keys(keep, x.shape[1])))
        h = self.cross_attn_norm(x)
        x = x + self.dropout(self.cross_attn.attend(h, cross_kv, src_allowed))
        x = x + self.dropout(self.ffn(self.ffn_norm(x)))
        return (src_x, src_pad, x, tgt_pad), DecoderCache(self_kv, keep, cross_kv, src_allowed)


class SourceTargetEmbedding(nn.Module):
    """Child 0: token embeddings * sqrt(D) + sinusoidal positions, dropout; builds the masks.

    Example::

        emb = SourceTargetEmbedding(vocab_size=100, d_model=32, max_len=64)
        src_x, src_pad, tgt_x, tgt_pad = emb((src_tokens, tgt_in_tokens))
    """

    positions: Tensor

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        max_len: int,
        dropout: float = 0.0,
        share: bool = True,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        self.pad_id, self.scale = pad_id, math.sqrt(d_model)
        self.src_tokens = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.tgt_tokens = (
            self.src_tokens if share else nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        )
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

    @property
    def max_len(self) -> int:
        """Longest sequence the position table covers (what decoding may reach)."""
        return int(self.positions.shape[0])

    def _embed(self, table: nn.Embedding, tokens: Tensor) -> tuple[Tensor, Tensor]:
        x = table(tokens) * self.scale + self.positions[: tokens.shape[1]]
        return self.dropout(x), tokens.eq(self.pad_id)

    def embed_source(self, src_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(states [B, S, D], padding mask [B, S])."""
        return self._embed(self.src_tokens, src_tokens)

    def embed_target(self, tgt_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(states [B, T, D], padding mask [B, T]); used by incremental decoding too."""
        return self._embed(self.tgt_tokens, tgt_tokens)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Batch4:
        src_tokens, tgt_tokens = inputs
        return (*self.embed_source(src_tokens), *self.embed_target(tgt_tokens))

    def forward_cached(
        self, inputs: tuple[Tensor, Tensor] | Tensor, cache: Seen | None
    ) -> tuple[Batch4, Seen]:
        """Incremental decoding: first ``(src_tokens, prefix)``, then the new target tokens
        [B, t] alone, embedded after the ``cache.length`` positions seen; the source comes out
        empty (the decoder layers cached theirs)."""
        if cache is None:
            assert isinstance(inputs, tuple), "the first call takes (src_tokens, prefix)"
            return self(inputs), Seen(inputs[1].shape[1])
        assert isinstance(inputs, Tensor), "later calls take the new target tokens"
        start, end = cache.length, cache.length + inputs.shape[1]
        if end > self.positions.shape[0]:
            raise ValueError(f"position {end - 1} is past model.max_len={self.positions.shape[0]}")
        tgt_x = self.tgt_tokens(inputs) * self.scale + self.positions[start:end]
        empty_x = tgt_x.new_zeros(tgt_x.shape[0], 0, tgt_x.shape[2])
        empty_pad = inputs.new_zeros(inputs.shape[0], 0, dtype=torch.bool)
        state = (empty_x, empty_pad, self.dropout(tgt_x), inputs.eq(self.pad_id))
        return state, Seen(end)


class EncoderDecoder(nn.Sequential):
    """The flat T(L, H, A) Sequential (what the engine partitions), plus what decoding needs
    without the engine: the encoder run once per batch (:meth:`encode`), the decoder and head on
    a target prefix (:meth:`decode_logits`; no key/value cache), and :attr:`max_len`.

    Both work on the plain model and on one whose children a pipeline spread over devices.

    Example::

        model = transformer_t(2, 64, 4, d_model=32, head_dim=8, vocab_size=100, max_len=64)
        src_x, src_pad = model.encode(src_tokens)
        logits = model.decode_logits(src_x, src_pad, prefix)     # == model((src_tokens, prefix))
    """

    @property
    def max_len(self) -> int:
        """Longest sequence the position table covers (source or target prefix)."""
        return int(_embedding(self).positions.shape[0])

    def encode(self, src_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Run the embedding and encoder once: (source states [B, S, D], source padding [B, S]),
        on the last encoder layer's device."""
        first, _ = split_points(self)
        embedding = _embedding(self)
        src_tokens = src_tokens.to(_device_of(embedding, src_tokens.device))
        src_x, src_pad = embedding.embed_source(src_tokens)
        empty_x = src_x.new_zeros(src_x.shape[0], 0, src_x.shape[2])
        empty_pad = src_pad.new_zeros(src_pad.shape[0], 0)
        state: Batch4 = (src_x, src_pad, empty_x, empty_pad)
        for layer in list(self)[1:first]:
            state = layer(_moved(state, layer))
        return state[0], state[1]

    def decode_logits(self, src_x: Tensor, src_pad: Tensor, prefix: Tensor) -> Tensor:
        """Logits [B, T, V] for target prefixes [B, T] given :meth:`encode`'s output, on the
        output head's device."""
        first, _ = split_points(self)
        embedding = _embedding(self)
        tgt_x, tgt_pad = embedding.embed_target(prefix.to(_device_of(embedding, prefix.device)))
        state: Batch4 | Tensor = (src_x, src_pad, tgt_x, tgt_pad)
        for layer in list(self)[first:]:
            assert isinstance(state, tuple)
            state = layer(_moved(state, layer))
        assert isinstance(state, Tensor)
        return state


def transformer_t(
    num_layers: int,
    ffn_dim: int,
    num_heads: int,
    *,
    d_model: int = 1024,
    head_dim: int = 64,
    vocab_size: int = 64000,
    dropout: float = 0.1,
    attn_dropout: float = 0.0,
    max_len: int = 1024,
    share_embeddings: bool = True,
    tie_embeddings: bool = False,
    ffn_init_scale: float | str | None = None,
    logit_clip: float | None = None,
    logit_clip_mode: str = "tanh",
    pad_id: int = 0,
) -> EncoderDecoder:
    """The paper's T(L, H, A): L encoder + L decoder layers, FFN width H, A heads of ``head_dim``.

    ``share_embeddings`` shares the source and target tables (both live in child 0);
    ``tie_embeddings`` also reuses the target table as the softmax weight, which puts one
    parameter in child 0 and child 2L+1 (see ``tied_parameter_layers``).

    Example::

        model = transformer_t(2, 64, 4, d_model=32, head_dim=8, vocab_size=100, max_len=64)
        logits = model((src_tokens, tgt_in_tokens))      # [B, T, 100]
        len(model) == 2 * 2 + 2
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if tie_embeddings and not share_embeddings:
        raise ValueError("tie_embeddings=True needs share_embeddings=True in this builder")
    sizes = (d_model, ffn_dim, num_heads, head_dim, dropout, attn_dropout)
    embedding = SourceTargetEmbedding(
        vocab_size, d_model, max_len, dropout, share_embeddings, pad_id
    )
    encoder = [EncoderLayer(*sizes) for _ in range(num_layers)]
    decoder = [DecoderLayer(*sizes, memory_norm=(i == 0)) for i in range(num_layers)]
    head = OutputHead(d_model, vocab_size, logit_clip, logit_clip_mode)
    if tie_embeddings:
        head.proj.weight = embedding.tgt_tokens.weight
    model = EncoderDecoder(embedding, *encoder, *decoder, head)
    init_weights(model, d_model, ffn_factor(ffn_init_scale, num_layers), pad_id)
    return model


def tied_parameter_layers(model: nn.Sequential) -> list[set[int]]:
    """Groups of child indices that share a parameter, e.g. ``[{0, 2L+1}]`` for tied softmax.

    A pipeline cut that separates the members of a group would leave copies on different
    stages that the engine cannot keep identical; the runner rejects such balances.

    Example::

        groups = tied_parameter_layers(transformer_t(2, 64, 4, d_model=32, head_dim=8,
                                                     vocab_size=100, tie_embeddings=True))
        groups == [{0, 5}]
    """
    owners: dict[int, set[int]] = {}
    for index, child in enumerate(model):
        for param in child.parameters():
            owners.setdefault(id(param), set()).add(index)
    groups: list[set[int]] = []
    for indices in owners.values():
        if len(indices) > 1 and indices not in groups:
            groups.append(indices)
    return sorted(groups, key=min)


def split_points(model: nn.Sequential) -> tuple[int, int]:
    """(index of the first decoder layer, index of the output head) of a ``transformer_t``.

    ``model[:first]`` is the encoder (with the embedding), ``model[first:head]`` the decoder.
    """
    first = next((i for i, c in enumerate(model) if isinstance(c, DecoderLayer)), None)
    if first is None or not isinstance(model[len(model) - 1], OutputHead):
        raise ValueError("split_points expects a model built by transformer_t")
    return first, len(model) - 1


def _embedding(model: nn.Sequential) -> SourceTargetEmbedding:
    embedding = model[0]
    if not isinstance(embedding, SourceTargetEmbedding):
        raise TypeError(f"child 0 must be a SourceTargetEmbedding, got {type(embedding).__name__}")
    return embedding


def _device_of(layer: nn.Module, default: torch.device) -> torch.device:
    return next((p.device for p in layer.parameters()), default)


def _moved(state: Batch4, layer: nn.Module) -> Batch4:
    """``state`` on ``layer``'s device: after a pipeline split the children may live on different
    devices, and decoding walks them one by one without the engine."""
    device = _device_of(layer, state[0].device)
    if state[0].device == device:
        return state
    src_x, src_pad, tgt_x, tgt_pad = (t.to(device) for t in state)
    return src_x, src_pad, tgt_x, tgt_pad


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, epsilon: float = 0.1, pad_id: int = 0
) -> tuple[Tensor, Tensor]:
    """(SUM of the label-smoothed loss over non-pad tokens, number of non-pad tokens).

    loss_t = (1 - eps) * -log p(y_t) + eps * mean_v(-log p(v)); padding positions count zero.
    Summing lets a pipeline divide by the global token count of the whole mini-batch.

    Example::

        total, ntokens = label_smoothed_cross_entropy(model((src, tgt_in)), tgt_out)
        loss = total / ntokens
    """
    logprobs = F.log_softmax(logits.float(), dim=-1)
    nll = -logprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -logprobs.mean(dim=-1)
    keep = target.ne(pad_id)
    per_token = (1.0 - epsilon) * nll + epsilon * smooth
    return per_token.masked_fill(~keep, 0.0).sum(), keep.sum()
