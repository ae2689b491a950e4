"""Hugging Face causal language models, built from their config classes with random weights.

Nothing is downloaded: ``AutoConfig.for_model(architecture, ...)`` and
``AutoModelForCausalLM.from_config`` make the model of the given shape. The builder returns the
Hugging Face module itself; the runner (``giantpipe.runner.build``) captures it as the flat
Sequential the engine cuts, with ``giantpipe.sequentialize``. Needs the ``hf`` extra
(``pip install -e ".[hf]"``); this module imports transformers only when a model is built.
:class:`HfCausalLmModelConfig` is the schema of ``model=hf_causal_lm``.

Example::

    from models.hf import hf_causal_lm

    model = hf_causal_lm("llama", layers=4, width=256, heads=4, vocab_size=1000)
    model(input_ids=torch.randint(0, 1000, (2, 16))).logits.shape     # (2, 16, 1000)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from models.checks import check, check_fraction, check_min

UNCAPTURABLE: dict[str, str] = {
    # found by capturing a tiny model of the type (transformers 5.24)
    "recurrent_gemma": "its forward asks its cache for a sequence length, which its recurrent "
    "layers do not keep (ValueError: get_seq_length can only be called on Attention layers)",
}
"""Model types that AutoModelForCausalLM builds but giantpipe.sequentialize cannot capture, and
why; refused by name before any work."""


def causal_lm_types() -> list[str]:
    """Model types ``AutoModelForCausalLM`` builds from a config (``llama``, ``gpt_neox``,
    ``phi``, ``gemma``, ``mixtral``, ...), less those listed in :data:`UNCAPTURABLE`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(UNCAPTURABLE))


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


@dataclass
class HfCausalLmModelConfig:
    """``model=hf_causal_lm``: the arguments of :func:`hf_causal_lm`, checked up front."""

    _target_: str = "models.hf.hf_causal_lm"
    """Builder called with the other fields."""
    architecture: str = "llama"
    """Hugging Face model type that AutoModelForCausalLM builds: llama, mistral, qwen2, gpt2,
    gpt_neox, phi, gemma, mixtral, ... (``models.hf.causal_lm_types()`` lists them)."""
    layers: int = 4
    """Decoder blocks (each a piece the balance can put on any stage)."""
    width: int = 256
    """Hidden size."""
    heads: int = 4
    """Attention heads (width must divide by them)."""
    vocab_size: int = 1000
    """Vocabulary (follows data.vocab_size)."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention (not gpt2); null: as many as heads."""
    ffn: int | None = None
    """FFN width; null: 4 x width (gpt2), else 8/3 x width rounded to 64."""
    max_len: int = 512
    """Longest sequence (position table / rotary cache); follows data.seq_len."""
    dropout: float = 0.0
    """Dropout (gpt2: residual, embedding and attention; others: attention)."""
    tie_embeddings: bool = False
    """One table for input and output embeddings (the engine keeps the stages' copies tied)."""
    seed: int = 0
    """Seed of the random weights."""
    config: dict[str, Any] = field(default_factory=dict)
    """Further keys of the type's config class, as they are (they win over the sizes above),
    e.g. ``+model.config.use_parallel_residual=false`` for gpt_neox."""

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        for key in ("layers", "width", "heads", "vocab_size", "max_len"):
            check_min(getattr(self, key), 1, f"model.{key}")
        check(self.width % self.heads == 0, "model.heads", f"must divide width {self.width}")
        if self.kv_heads is not None:
            check(
                self.kv_heads >= 1 and self.heads % self.kv_heads == 0,
                "model.kv_heads",
                f"must divide heads {self.heads}, got {self.kv_heads}",
            )
        check_fraction(self.dropout, "model.dropout")
        check(isinstance(self.config, dict), "model.config", "must be a mapping of config keys")


def _check_architecture(architecture: str) -> None:
    check(
        architecture not in UNCAPTURABLE,
        "model.architecture",
        f"{architecture!r} cannot be captured: {UNCAPTURABLE.get(architecture)}",
    )
    try:
        types = causal_lm_types()
    except ImportError:  # without transformers the builder says what to install
        return
    check(
        architecture in types,
        "model.architecture",
        f"{architecture!r} is not a model type AutoModelForCausalLM builds; one of "
        f"{', '.join(types[:12])}, ... (models.hf.causal_lm_types() lists all {len(types)})",
    )
