"""Transformers for GPipe: the paper's T(L, H, A) encoder-decoder and decoder-only Transformer-L.

Both builders return ONE flat ``nn.Sequential`` whose children are the units of partitioning, so
any cut between two children is a valid pipeline boundary.

Encoder-decoder ``transformer_t(L, H, A)``, 2L + 2 children, every boundary a 4-tuple::

    index      child                  takes                        returns
    0          SourceTargetEmbedding  (src_tokens, tgt_in_tokens)  (src_x, src_pad, tgt_x, tgt_pad)
    1 .. L     EncoderLayer           the 4-tuple                  the 4-tuple, src_x updated
    L+1 .. 2L  DecoderLayer           the 4-tuple                  the 4-tuple, tgt_x updated
    2L+1       OutputHead             the 4-tuple                  logits [B, T, V]

``src_x`` [B, S, D] and ``tgt_x`` [B, T, D] are float states; ``src_pad`` [B, S] and ``tgt_pad``
[B, T] are bool masks, True at padding (they never require grad). The target is embedded in
child 0 together with the source so that a shared source/target table lives in one child; the
target states ride unchanged through the encoder layers. The first decoder layer applies the
encoder's final LayerNorm to ``src_x`` (pre-norm stacks need one).

Decoder-only ``transformer_lm(L)``: [LMEmbedding, L DecoderOnlyLayer, LMHead], tensors [B, T, D]
between children, int64 tokens in, logits out; parameters = 50,358,272 L + 131,072,000 exactly.

Stabilizers from the paper (Section 5), both off by default:

- ``ffn_init_scale``: the weights of both linear maps of every feed-forward block are initialised
  as usual (Xavier uniform) and then multiplied by 1/sqrt(2L) (``"sqrt"``) or 1/L (``"linear"``),
  L = layers per stack; a float gives the factor directly.
- ``logit_clip``: logits whose magnitude exceeds the threshold c are clipped, either smoothly,
  ``c * tanh(logits / c)`` (``logit_clip_mode="tanh"``, default, keeps gradients), or hard,
  ``clamp(logits, -c, c)`` (``"clamp"``). Either way |logits| <= c.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "transformer_t",
    "transformer_lm",
    "tied_parameter_layers",
    "split_points",
    "encode",
    "decode_logits",
    "label_smoothed_cross_entropy",
    "count_parameters",
]

Batch4 = tuple[Tensor, Tensor, Tensor, Tensor]


def sinusoidal_positions(max_len: int, dim: int) -> Tensor:
    """Fixed sin/cos position table [max_len, dim] (Vaswani et al.); no parameters."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(max_len, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return table


def _allowed(key_pad: Tensor | None, causal_len: int | None = None) -> Tensor:
    """Bool mask [B|1, 1, Tq|1, Tk], True where attention is permitted.

    Rows with every key masked (an empty source) fall back to attending everywhere so that the
    softmax never sees an all -inf row.
    """
    masks = []
    if key_pad is not None:
        masks.append((~key_pad)[:, None, None, :])
    if causal_len is not None:
        device = key_pad.device if key_pad is not None else None
        ones = torch.ones(causal_len, causal_len, dtype=torch.bool, device=device)
        masks.append(ones.tril()[None, None])
    allowed = masks[0] if len(masks) == 1 else masks[0] & masks[1]
    return allowed | ~allowed.any(dim=-1, keepdim=True)


class MultiHeadAttention(nn.Module):
    """Attention of width ``num_heads * head_dim`` (it widens with the number of heads).

    Example::

        attn = MultiHeadAttention(d_model=32, num_heads=4, head_dim=8)
        y = attn(x, x, torch.ones(1, 1, 1, x.shape[1], dtype=torch.bool))
    """

    def __init__(
        self, d_model: int, num_heads: int, head_dim: int, dropout: float = 0.0, bias: bool = True
    ) -> None:
        super().__init__()
        width = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.q_proj = nn.Linear(d_model, width, bias=bias)
        self.k_proj = nn.Linear(d_model, width, bias=bias)
        self.v_proj = nn.Linear(d_model, width, bias=bias)
        self.out_proj = nn.Linear(width, d_model, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, query: Tensor, memory: Tensor, allowed: Tensor) -> Tensor:
        q = self._heads(self.q_proj(query))
        k, v = self._heads(self.k_proj(memory)), self._heads(self.v_proj(memory))
        if self.training and self.attn_dropout.p > 0:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
            out = self.attn_dropout(weights) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out_proj(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """Linear(D, H) -> ReLU -> Dropout -> Linear(H, D)."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(ffn_dim, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


class SelfAttentionLayer(nn.Module):
    """Pre-norm self-attention + feed-forward block; the subclasses choose the boundary format."""

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        num_heads: int,
        head_dim: int,
        dropout: float,
        attn_dropout: float,
    ) -> None:
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, num_heads, head_dim, attn_dropout)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def block(self, x: Tensor, allowed: Tensor) -> Tensor:
        h = self.self_attn_norm(x)
        x = x + self.dropout(self.self_attn(h, h, allowed))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class EncoderLayer(SelfAttentionLayer):
    """Encoder layer on the 4-tuple: updates the source states, carries the rest."""

    def forward(self, inputs: Batch4) -> Batch4:
        src_x, src_pad, tgt_x, tgt_pad = inputs
        return self.block(src_x, _allowed(src_pad)), src_pad, tgt_x, tgt_pad


class DecoderOnlyLayer(SelfAttentionLayer):
    """Causal self-attention layer of Transformer-L: tensor [B, T, D] in and out."""

    def forward(self, x: Tensor) -> Tensor:
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        return self.block(x, causal[None, None])


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
        x = x + self.dropout(self.self_attn(h, h, _allowed(tgt_pad, causal_len=x.shape[1])))
        h = self.cross_attn_norm(x)
        x = x + self.dropout(self.cross_attn(h, src_x, _allowed(src_pad)))
        x = x + self.dropout(self.ffn(self.ffn_norm(x)))
        return src_x, src_pad, x, tgt_pad


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


def clip_logits(logits: Tensor, cap: float | None, mode: str = "tanh") -> Tensor:
    """Bound |logits| by ``cap``: ``cap * tanh(logits / cap)`` or ``clamp(-cap, cap)``."""
    if cap is None:
        return logits
    if mode == "tanh":
        return cap * torch.tanh(logits / cap)
    if mode == "clamp":
        return logits.clamp(-cap, cap)
    raise ValueError(f"logit_clip_mode must be 'tanh' or 'clamp', got {mode!r}")


class OutputHead(nn.Module):
    """Last child: final norm, bias-free projection to the vocabulary, optional logit clipping.

    Accepts the 4-tuple of the encoder-decoder (uses the target states) or a tensor [B, T, D].
    """

    def __init__(
        self,
        d_model: int,
        vocab_size: int,
        logit_clip: float | None = None,
        logit_clip_mode: str = "tanh",
        norm_affine: bool = True,
    ) -> None:
        super().__init__()
        clip_logits(torch.zeros(1), logit_clip, logit_clip_mode)  # validates the mode early
        self.norm = nn.LayerNorm(d_model, elementwise_affine=norm_affine)
        self.proj = nn.Linear(d_model, vocab_size, bias=False)
        self.logit_clip, self.logit_clip_mode = logit_clip, logit_clip_mode

    def forward(self, inputs: Batch4 | Tensor) -> Tensor:
        x = inputs[2] if isinstance(inputs, tuple) else inputs
        return clip_logits(self.proj(self.norm(x)), self.logit_clip, self.logit_clip_mode)


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
        return self.dropout(self.tokens(tokens) * self.scale + self.positions[: tokens.shape[1]])


def _ffn_factor(ffn_init_scale: float | str | None, num_layers: int) -> float:
    if ffn_init_scale is None:
        return 1.0
    if ffn_init_scale == "sqrt":
        return 1.0 / math.sqrt(2 * num_layers)
    if ffn_init_scale == "linear":
        return 1.0 / num_layers
    if isinstance(ffn_init_scale, (int, float)) and ffn_init_scale > 0:
        return float(ffn_init_scale)
    raise ValueError(
        f"ffn_init_scale must be None, 'sqrt', 'linear' or > 0, got {ffn_init_scale!r}"
    )


@torch.no_grad()
def _init_weights(model: nn.Module, d_model: int, ffn_factor: float, pad_id: int | None) -> None:
    """Xavier-uniform linears, zero biases, N(0, D^-1/2) embeddings; FFN weights * ffn_factor."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=d_model**-0.5)
            if pad_id is not None and module.weight.device.type != "meta":
                module.weight[pad_id].zero_()
    for module in model.modules():
        if isinstance(module, FeedForward):
            module.fc1.weight.mul_(ffn_factor)
            module.fc2.weight.mul_(ffn_factor)
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    for module in model.modules():  # an untied softmax gets the embedding's scale too
        if isinstance(module, OutputHead) and all(module.proj.weight is not w for w in embeddings):
            nn.init.normal_(module.proj.weight, std=d_model**-0.5)


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
) -> nn.Sequential:
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
    model = nn.Sequential(embedding, *encoder, *decoder, head)
    _init_weights(model, d_model, _ffn_factor(ffn_init_scale, num_layers), pad_id)
    return model


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
    _init_weights(model, d_model, _ffn_factor(ffn_init_scale, num_layers), pad_id=None)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


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


def encode(model: nn.Sequential, src_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Run the embedding and encoder once: (source states [B, S, D], source padding [B, S])."""
    first, _ = split_points(model)
    src_x, src_pad = _embedding(model).embed_source(src_tokens)
    empty_x = src_x.new_zeros(src_x.shape[0], 0, src_x.shape[2])
    empty_pad = src_pad.new_zeros(src_pad.shape[0], 0)
    state: Batch4 = (src_x, src_pad, empty_x, empty_pad)
    for layer in model[1:first]:
        state = layer(state)
    return state[0], state[1]


def decode_logits(model: nn.Sequential, src_x: Tensor, src_pad: Tensor, prefix: Tensor) -> Tensor:
    """Logits [B, T, V] for target prefixes [B, T] given ``encode``'s output (no engine needed)."""
    first, _ = split_points(model)
    state: Batch4 | Tensor = (src_x, src_pad, *_embedding(model).embed_target(prefix))
    for layer in model[first:]:
        state = layer(state)
    assert isinstance(state, Tensor)
    return state


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
