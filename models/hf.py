"""Hugging Face causal language models, built from their config classes with random weights.

Nothing is downloaded (``AutoModelForCausalLM.from_config``); the runner captures the module
with ``giantpipe.sequentialize``, and :func:`give_caches` lets the pieces of the types in
:data:`CACHED_TYPES` decode with caches (docs/generation.md#what-a-models-children-offer).
Needs the ``hf`` extra; transformers is imported only when a model is built.

Example::

    from models.hf import hf_causal_lm

    model = hf_causal_lm("llama", layers=4, width=256, heads=4, vocab_size=1000)
    model(input_ids=torch.randint(0, 1000, (2, 16))).logits.shape     # (2, 16, 1000)
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def hf_causal_lm(
    architecture: str = "llama",
    layers: int = 4,
    width: int = 256,
    heads: int = 4,
    vocab_size: int = 1000,
    kv_heads: int | None = None,
    ffn: int | None = None,
    max_len: int = 512,
    dropout: float = 0.0,
    tie_embeddings: bool = False,
    seed: int = 0,
    config: dict[str, Any] | None = None,
) -> nn.Module:
    """A ``*ForCausalLM`` of any model type (``architecture``: ``llama``, ``gpt_neox``, ``phi``,
    ``gemma``, ``mixtral``, ...) with ``layers`` blocks of ``width``, ``heads`` attention heads
    (``kv_heads`` for grouped queries, default all), an FFN of ``ffn`` (default 4x width for
    gpt2, 8/3 x width rounded to 64 otherwise) and ``vocab_size`` tokens; weights drawn under
    ``seed``. Each size is set where the type's config has the key (under its own name: gpt2's
    ``n_layer``); ``config`` holds further keys of that config class, passed as they are and
    winning over the sizes (``{"use_parallel_residual": False}``, ``{"num_local_experts": 4}``)."""
    try:
        import transformers
    except ImportError as err:  # the optional extra
        raise ImportError('model=hf_causal_lm needs transformers: pip install -e ".[hf]"') from err
    sizes = _sizes(width, heads, kv_heads or heads, ffn, dropout)
    known = transformers.AutoConfig.for_model(architecture)  # the type's own keys
    kwargs = {k: v for k, v in sizes.items() if hasattr(known, k)}
    kwargs |= _config_keys(architecture, layers, width, heads, vocab_size, max_len)
    kwargs["tie_word_embeddings"] = tie_embeddings
    made = transformers.AutoConfig.for_model(architecture, **{**kwargs, **(config or {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(made)
    # what the runner calls once the model is captured (a plain function: no cycle to the model)
    setattr(model, "giantpipe_cache_pieces", give_caches)  # noqa: B010 - not a module field
    return model


def _config_keys(
    architecture: str, layers: int, width: int, heads: int, vocab_size: int, max_len: int
) -> dict[str, Any]:
    # bos / eos / pad inside the vocabulary (the defaults, e.g. GPT-2's 50256, may not be)
    return {
        "num_hidden_layers": layers,
        "hidden_size": width,
        "num_attention_heads": heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_len,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def _sizes(
    width: int, heads: int, kv_heads: int, ffn: int | None, dropout: float
) -> dict[str, Any]:
    """The keys, under the names the config classes use, that only some of them have."""
    return {
        "num_key_value_heads": kv_heads,
        "head_dim": width // heads,  # Gemma's default (256) ignores the width
        "intermediate_size": ffn or 64 * max(1, round(width * 8 / 3 / 64)),
        "n_inner": ffn or 4 * width,  # gpt2
        "attention_dropout": dropout,
        "resid_pdrop": dropout,  # gpt2: residual, embedding and attention
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
    }


# ---- key/value caches for the captured pieces ---------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where a family's parts are (submodule names); a family with rotary positions calls its
    decoder layers as Llama's model does, one without as GPT-2's does."""

    tokens: str
    layers: str
    norm: str
    head: str = "lm_head"
    rotary: str | None = None
    """Rotary positions (cos, sin), computed in the first piece and carried along."""
    positions: str | None = None
    """A learnt position table, added to the token embeddings (gpt2)."""
    dropout: str | None = None
    """Dropout on the embeddings (gpt2; off in generation, which runs in eval mode)."""


LLAMA = Layout("model.embed_tokens", "model.layers", "model.norm", rotary="model.rotary_emb")
GPT2 = Layout(
    "transformer.wte",
    "transformer.h",
    "transformer.ln_f",
    positions="transformer.wpe",
    dropout="transformer.drop",
)

LLAMA_FAMILY = [
    # Their *ForCausalLM and base-model forwards are Llama's, but for choosing each layer's mask
    # (sliding windows) by its layer type, and their decoder layers take Llama's arguments; the
    # cached logits of a tiny model of each (a window of 4 where the type has one) equal its
    # full forward's (tests/unit/models/test_hf_cache.py; found with transformers 5.24). Left
    # out: cohere, phi, persimmon (their logits differ: a scale, a partial rotary), gemma, cwm,
    # granite, starcoder2 and the mixtures of experts (their forwards add to Llama's).
    "apertus", "arcee", "bitnet", "diffllama", "ernie4_5", "exaone", "exaone4", "glm", "glm4",
    "helium", "hunyuan_v1_dense", "internlm3", "iquestcoder", "jais2", "llama", "ministral",
    "mistral", "olmo", "olmo2", "phi3", "qwen2", "qwen3",
]  # fmt: skip
CACHED_TYPES: dict[str, Layout] = {"gpt2": GPT2} | {name: LLAMA for name in LLAMA_FAMILY}
"""Model types whose captured pieces can keep key/value caches, and their layout; every other
type is refused by name where generation is asked for."""


def cached_types() -> list[str]:
    """The model types :func:`give_caches` serves.

    >>> [t for t in cached_types() if t in ("gpt2", "llama", "mistral", "qwen2")]
    ['gpt2', 'llama', 'mistral', 'qwen2']
    """
    return sorted(CACHED_TYPES)


@dataclass
class PieceCache:
    """One piece's cache: the Hugging Face ``DynamicCache`` of its decoder layers (None: it has
    none) and how many positions it has seen (the next position id). Prompts of unequal length
    add ``mask`` [B, seen] (1 at tokens, 0 at the left padding, the attention mask Hugging Face
    takes) and ``next`` [B], each row's next position.

    Example::

        cache = cache.reorder(torch.tensor([1, 1]))   # row 1 twice (two beams of one parent)
    """

    layers: Any
    length: int
    mask: torch.Tensor | None = None
    next: torch.Tensor | None = None

    def reorder(self, index: torch.Tensor) -> PieceCache:
        if self.layers is not None:  # in place: the old order is not needed again
            self.layers.reorder_cache(index)
        if self.mask is not None and self.next is not None:
            self.mask = self.mask.index_select(0, index.to(self.mask.device))
            self.next = self.next.index_select(0, index.to(self.next.device))
        return self

    def positions(self, new: int, keep: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """Position ids [1 | B, new] of the ``new`` positions, the mask grown by them: a padded
        prompt's (``keep``) count each row's tokens from 0, as Hugging Face's ``generate``
        does; later ones follow each row's last."""
        if keep is not None:
            self.mask = keep.long()
            self.next = self.mask.sum(dim=1)
            return (self.mask.cumsum(dim=1) - 1).masked_fill(self.mask == 0, 0)
        if self.mask is None or self.next is None:
            return torch.arange(self.length, self.length + new, device=device)[None]
        positions = self.next[:, None] + torch.arange(new, device=device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], new)], dim=1)
        self.next = self.next + new
        return positions


class PieceDecoder:
    """A piece's ``forward_cached``: the original submodules it spans, run incrementally.

    Not a module (the piece's state dict stays the captured one): it runs the Hugging Face
    submodules on the piece's current tensors (the engine may move or copy them per device),
    bound by identity when it was made. It holds the piece only weakly and the submodules of
    this piece only, so a rank keeps no other stage's weights alive.
    """

    def __init__(
        self, model: nn.Module, piece: nn.Module, span: Collection[str], layout: Layout
    ) -> None:
        config = _config(model)
        count = int(config.num_hidden_layers)
        self.config, self.layout, self.piece = config, layout, weakref.ref(piece)
        self.layer_ids = [i for i in range(count) if f"{layout.layers}.{i}" in span]
        names = [layout.tokens, layout.rotary, layout.positions, layout.dropout, layout.norm]
        parts = {n: model.get_submodule(n) for n in names if n is not None and n in span}
        parts |= {
            f"{layout.layers}.{i}": model.get_submodule(f"{layout.layers}.{i}")
            for i in self.layer_ids
        }
        if layout.head in span:
            parts[layout.head] = model.get_submodule(layout.head)
        self.parts = parts
        self.modules = list(dict.fromkeys(m for part in parts.values() for m in part.modules()))
        self.kinds = _layer_kinds(config)
        self.bindings = _bindings(list(parts.values()), piece)

    def __call__(self, inputs: Any, cache: PieceCache | None) -> tuple[Any, PieceCache]:
        flipped = self._bind()
        try:
            return self._run(inputs, PieceCache(self._new_layers(), 0) if cache is None else cache)
        finally:
            for module in flipped:  # the model's own submodules: left in the mode found
                module.training = not module.training

    def _run(self, inputs: Any, cache: PieceCache) -> tuple[Any, PieceCache]:
        """The piece's submodules on ``inputs``: token ids (or ``(ids, keep)``, a padded prompt)
        in the first piece, else (hidden, *extras) with ``keep`` last on a padded prompt."""
        layout, parts = self.layout, self.parts
        keep = None
        if layout.tokens in parts:
            tokens, keep = inputs if isinstance(inputs, tuple) else (inputs, None)
            positions = cache.positions(tokens.shape[1], keep, tokens.device)
            hidden, extras = self._embed(tokens, positions)
        else:
            hidden, *rest = inputs if isinstance(inputs, tuple) else (inputs,)
            if len(rest) > (2 if layout.rotary is not None else 0):  # (cos, sin) and keep
                keep = rest.pop()
            extras = tuple(rest)
            positions = cache.positions(hidden.shape[1], keep, hidden.device)
        if self.layer_ids:
            hidden = self._layers(hidden, extras, positions, cache)
        cache.length += hidden.shape[1]
        if layout.norm in parts:
            hidden = parts[layout.norm](hidden)
        if layout.head in parts:  # logits of the last position: what scores the next token
            return parts[layout.head](hidden[:, -1:]), cache
        out = (hidden, *extras, keep) if keep is not None else (hidden, *extras)
        return (out if len(out) > 1 else hidden), cache

    def _bind(self) -> list[nn.Module]:
        """The piece's tensors bound into the submodules; those whose mode differs from the
        piece's flipped to it (returned: the call flips them back)."""
        piece = self.piece()
        training = bool(piece is not None and piece.training)
        for owner, kind, name, source, source_kind, source_name in self.bindings:
            tensor = getattr(source, source_kind)[source_name]
            if getattr(owner, kind)[name] is not tensor:
                getattr(owner, kind)[name] = tensor
        flipped = [m for m in self.modules if m.training != training]
        for module in flipped:
            module.training = training
        return flipped

    def _new_layers(self) -> Any:
        if not self.layer_ids:
            return None
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        layout, parts = self.layout, self.parts
        hidden = parts[layout.tokens](tokens)
        if layout.positions is not None:
            hidden = hidden + parts[layout.positions](positions)
        if layout.dropout is not None:
            hidden = parts[layout.dropout](hidden)
        if layout.rotary is None:
            return hidden, ()
        cos, sin = parts[layout.rotary](hidden, position_ids=positions)
        return hidden, (cos, sin)

    def _layers(
        self, hidden: torch.Tensor, extras: tuple, positions: torch.Tensor, cache: PieceCache
    ) -> torch.Tensor:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        makers = {"full_attention": create_causal_mask}
        makers["sliding_attention"] = create_sliding_window_causal_mask
        masks: dict[str, Any] = {}
        layers = cache.layers
        for i in self.layer_ids:  # as the model does: every mask before any layer grows its cache
            kind = self.kinds[i]
            if kind not in masks:
                masks[kind] = makers[kind](
                    config=self.config,
                    inputs_embeds=hidden,
                    attention_mask=cache.mask,  # None: no padding, every position a token
                    cache=layers,
                    position_ids=positions,
                    layer_idx=i,
                )
        for i in self.layer_ids:
            layer = self.parts[f"{self.layout.layers}.{i}"]
            mask = masks[self.kinds[i]]
            if self.layout.rotary is not None:
                hidden = layer(
                    hidden,
                    attention_mask=mask,
                    position_ids=positions,
                    cache=layers,
                    use_cache=True,
                    position_embeddings=extras,
                )
            else:
                hidden = layer(hidden, layers, mask, use_cache=True, position_ids=positions)
        return hidden


def _config(model: nn.Module) -> Any:
    """The Hugging Face config of ``model`` (a PretrainedConfig, not a module field)."""
    return getattr(model, "config")  # noqa: B009


def _layer_kinds(config: Any) -> list[str]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    return list(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])


def _bindings(parts: Sequence[nn.Module], piece: nn.Module) -> list[tuple]:
    """(submodule, "_parameters" | "_buffers", name, piece's owner, kind, name) for every
    tensor of ``parts`` that ``piece`` holds, found by identity."""
    held: dict[int, tuple[nn.Module, str, str]] = {}
    for owner in piece.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                if tensor is not None:
                    held.setdefault(id(tensor), (owner, kind, name))
    out = []
    for part in parts:
        for owner in part.modules():
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(owner, kind).items():
                    if tensor is not None and id(tensor) in held:
                        out.append((owner, kind, name, *held[id(tensor)]))
    return out


def _layer_owners(spans: Sequence[Collection[str]], layout: Layout, count: int) -> list[list[int]]:
    return [
        [p for p, span in enumerate(spans) if f"{layout.layers}.{i}" in span] for i in range(count)
    ]


def why_uncached(model: nn.Module, spans: Sequence[Collection[str]]) -> str | None:
    """Why the pieces cut at ``spans`` cannot keep caches (the type, or a layer cut in two);
    None when they can."""
    kind = str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))
    layout = CACHED_TYPES.get(kind)
    if layout is None:
        return (
            f"Hugging Face type {kind!r} has no key/value cache for its pieces yet; these "
            f"have: {', '.join(cached_types())}"
        )
    count = int(_config(model).num_hidden_layers)
    for i, owners in enumerate(_layer_owners(spans, layout, count)):
        if len(owners) != 1:
            return f"decoder layer {layout.layers}.{i} is cut across pieces {owners}"
    ends = [(layout.tokens, 0), (layout.head, len(spans) - 1)]
    for name, piece in ends:
        if name not in spans[piece]:
            return f"{name} is not in piece {piece}"
    return None


def give_caches(
    model: nn.Module, pieces: Sequence[nn.Module], spans: Sequence[Collection[str]]
) -> None:
    """Gives every piece of ``model`` (captured: ``spans[i]``, the submodule names piece i runs)
    a ``forward_cached``; where it cannot (:func:`why_uncached`), each piece says why in
    ``no_cache_reason`` instead, and generation refuses it by that reason.

    Example::

        seq = sequentialize(model, ids, output="logits")
        give_caches(model, list(seq), seq.spans)
        generate(GPipe(seq, balance=[2, 2], devices=["cpu"] * 2, chunks=2), [ids], [8], Decoding())
    """
    reason = why_uncached(model, spans)
    for piece, span in zip(pieces, spans, strict=True):
        if reason is not None:
            setattr(piece, "no_cache_reason", reason)  # noqa: B010 - not a module field
        else:
            layout = CACHED_TYPES[_config(model).model_type]
            setattr(piece, "forward_cached", PieceDecoder(model, piece, span, layout))  # noqa: B010
