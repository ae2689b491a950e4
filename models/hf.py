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

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.checks import check, check_choice, check_fraction, check_min

ARCHITECTURES = ("llama", "mistral", "qwen2", "gpt2")
"""Model types whose configs take the common keys below (gpt2 maps them to its own names)."""


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
) -> nn.Module:
    """A ``*ForCausalLM`` of ``layers`` blocks of ``width`` with ``heads`` attention heads
    (``kv_heads`` for grouped queries, default all), an FFN of ``ffn`` (default 4x width, Llama's
    8/3 x width rounded to 64) and ``vocab_size`` tokens; weights drawn under ``seed``."""
    try:
        import transformers
    except ImportError as err:  # the optional extra
        raise ImportError('model=hf_causal_lm needs transformers: pip install -e ".[hf]"') from err
    config = transformers.AutoConfig.for_model(
        architecture, **_config_keys(architecture, layers, width, heads, vocab_size, max_len)
    )
    _set_sizes(config, architecture, width, kv_heads or heads, ffn, dropout)
    config.tie_word_embeddings = tie_embeddings
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
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


def _set_sizes(
    config: Any, architecture: str, width: int, kv_heads: int, ffn: int | None, dropout: float
) -> None:
    if architecture == "gpt2":
        config.n_inner = ffn or 4 * width
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = dropout
        return
    config.num_key_value_heads = kv_heads
    config.intermediate_size = ffn or 64 * max(1, round(width * 8 / 3 / 64))
    config.attention_dropout = dropout


@dataclass
class HfCausalLmModelConfig:
    """``model=hf_causal_lm``: the arguments of :func:`hf_causal_lm`, checked up front."""

    _target_: str = "models.hf.hf_causal_lm"
    """Builder called with the other fields."""
    architecture: str = "llama"
    """Hugging Face model type: llama, mistral, qwen2 or gpt2."""
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

    def __post_init__(self) -> None:
        check_choice(self.architecture, ARCHITECTURES, "model.architecture")
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
