"""Building blocks shared by the paper's Transformers (``models.transformer``, ``.transformer_lm``).

Pre-norm attention and feed-forward blocks, the output head with the paper's logit clipping,
sinusoidal positions and the scaled feed-forward initialisation
(docs/paper-tables.md#the-transformers), and the caches of incremental decoding, padded
prompts included (docs/generation.md#what-a-models-children-offer).

Example::

    head = OutputHead(d_model=32, vocab_size=100, logit_clip=30.0)
    logits = head(torch.randn(2, 5, 32))          # |logits| <= 30
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The schemas' checks of these blocks' arguments live in models.checks (no torch there: the
# command line runs them before importing torch); kept importable from here.
from models.checks import check_dropouts, check_stabilizers

Batch4 = tuple[Tensor, Tensor, Tensor, Tensor]

__all__ = [
    "KVCache",
    "Seen",
    "SeenRows",
    "allowed_keys",
    "sinusoidal_positions",
    "attention_mask",
    "MultiHeadAttention",
    "FeedForward",
    "SelfAttentionLayer",
    "clip_logits",
    "OutputHead",
    "ffn_factor",
    "init_weights",
    "count_parameters",
    "check_stabilizers",
    "check_dropouts",
]


def sinusoidal_positions(max_len: int, dim: int) -> Tensor:
    """Fixed sin/cos position table [max_len, dim] (Vaswani et al.); no parameters."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(max_len, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return table


def attention_mask(key_pad: Tensor | None, causal_len: int | None = None) -> Tensor:
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


@dataclass
class KVCache:
    """Keys and values [B, heads, T, head_dim] of one attention, for the positions seen so far;
    ``keep`` [B, T] (None: every position) says which of them are tokens, not padding.

    Example::

        cache = KVCache(k, v).extend(k_new, v_new)   # T grows by k_new.shape[2]
        cache = cache.reorder(torch.tensor([1, 1]))  # row 1 twice (two beams of one parent)
    """

    key: Tensor
    value: Tensor
    keep: Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.key.shape[2])

    def extend(self, key: Tensor, value: Tensor) -> KVCache:
        keep = self.keep
        if keep is not None:  # new positions are tokens: decoding drops finished rows
            keep = torch.cat([keep, keep.new_ones(keep.shape[0], key.shape[2])], dim=1)
        key, value = torch.cat([self.key, key], dim=2), torch.cat([self.value, value], dim=2)
        return KVCache(key, value, keep)

    def reorder(self, index: Tensor) -> KVCache:
        index = index.to(self.key.device)
        keep = None if self.keep is None else self.keep.index_select(0, index)
        return KVCache(self.key.index_select(0, index), self.value.index_select(0, index), keep)


@dataclass
class Seen:
    """The cache of a child that keeps no tensors: how many positions it has seen (an
    embedding's next position; an encoder layer's source, encoded once)."""

    length: int

    def reorder(self, index: Tensor) -> Seen:
        return self


@dataclass
class SeenRows:
    """An embedding's cache when the prompts had unequal lengths: each row's next position
    [B] (its own tokens seen so far, padding not counted)."""

    next: Tensor

    def reorder(self, index: Tensor) -> SeenRows:
        return SeenRows(self.next.index_select(0, index.to(self.next.device)))


def causal_block(queries: int, keys: int, device: torch.device) -> Tensor | None:
    """Mask [1, 1, queries, keys] for the last ``queries`` of ``keys`` positions attending to
    themselves and earlier ones; None for a single query (it sees every key).

    >>> causal_block(2, 3, torch.device("cpu")).int().tolist()
    [[[[1, 1, 0], [1, 1, 1]]]]
    """
    if queries == 1:
        return None
    ones = torch.ones(queries, keys, dtype=torch.bool, device=device)
    return ones.tril(diagonal=keys - queries)[None, None]


def allowed_keys(keep: Tensor, queries: int) -> Tensor:
    """Self-attention mask [B, 1, queries, T] of the last ``queries`` positions: causal, no
    padding keys (``keep`` [B, T] False), a row with every key masked attending everywhere (as
    :func:`attention_mask`: a padding query's output is never read, and the softmax never sees a
    row of -inf).

    >>> allowed_keys(torch.tensor([[False, True, True]]), 3).int().tolist()
    [[[[1, 1, 1], [0, 1, 0], [0, 1, 1]]]]
    """
    allowed = keep[:, None, None, :]
    block = causal_block(queries, keep.shape[1], keep.device)
    if block is not None:
        allowed = allowed & block
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

    def keys_values(self, memory: Tensor) -> KVCache:
        """The keys and values of ``memory`` [B, T, D], split into heads (what a cache keeps)."""
        return KVCache(self._heads(self.k_proj(memory)), self._heads(self.v_proj(memory)))

    def forward(self, query: Tensor, memory: Tensor, allowed: Tensor | None) -> Tensor:
        return self.attend(query, self.keys_values(memory), allowed)

    def attend(self, query: Tensor, kv: KVCache, allowed: Tensor | None) -> Tensor:
        """Attention of ``query`` [B, Tq, D] over keys and values already projected
        (``allowed`` [B|1, 1, Tq|1, Tk] or None: every key)."""
        q, k, v = self._heads(self.q_proj(query)), kv.key, kv.value
        if self.training and self.attn_dropout.p > 0 and allowed is not None:
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

    def causal_block_cached(
        self, x: Tensor, cache: KVCache | None, keep: Tensor | None = None
    ) -> tuple[Tensor, KVCache]:
        """:meth:`block` with causal attention for new positions ``x`` [B, t, D] after those
        in ``cache`` (None: none before; ``keep`` [B, t]: which of the prompt's positions are
        tokens); returns the states and the grown cache."""
        h = self.self_attn_norm(x)
        kv = self.self_attn.keys_values(h)
        kv = KVCache(kv.key, kv.value, keep) if cache is None else cache.extend(kv.key, kv.value)
        if kv.keep is None:
            allowed = causal_block(x.shape[1], kv.length, x.device)
        else:
            allowed = allowed_keys(kv.keep, x.shape[1])
        x = x + self.dropout(self.self_attn.attend(h, kv, allowed))
        return x + self.dropout(self.ffn(self.ffn_norm(x))), kv


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

    def forward_cached(
        self, inputs: Batch4 | tuple[Tensor, Tensor] | Tensor, cache: None
    ) -> tuple[Tensor, None]:
        """Incremental decoding: logits [B, 1, V] of the last position only (no state); a
        language model's padded prompt comes as (states, keep), its last position a token."""
        if isinstance(inputs, tuple):
            x = inputs[2] if len(inputs) == 4 else inputs[0]
        else:
            x = inputs
        return self(x[:, -1:]), None


def ffn_factor(ffn_init_scale: float | str | None, num_layers: int) -> float:
    """The paper's first stabilizer: the factor every feed-forward weight is multiplied by.

    Example::

        ffn_factor("sqrt", 24)   # 1 / sqrt(48) = 0.144
    """
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
def init_weights(model: nn.Module, d_model: int, factor: float, pad_id: int | None) -> None:
    """Xavier-uniform linears, zero biases, N(0, D^-1/2) embeddings; FFN weights * factor."""
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
            module.fc1.weight.mul_(factor)
            module.fc2.weight.mul_(factor)
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    for module in model.modules():  # an untied softmax gets the embedding's scale too
        if isinstance(module, OutputHead) and all(module.proj.weight is not w for w in embeddings):
            nn.init.normal_(module.proj.weight, std=d_model**-0.5)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())
