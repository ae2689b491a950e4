"""The model options' schemas: one dataclass per ``conf/model/*.yaml``, importing no torch.

Each schema types its builder's arguments and checks them in ``__post_init__``, raising
``ValueError("model.KEY: problem")``, so the command line checks a model before it imports
torch; a rule that needs an installed package's list goes in ``check_installed()``, called once
torch is imported (docs/command-line.md#errors-come-first-and-fast).

Example::

    from models.options import MlpModelConfig, TorchvisionModelConfig

    MlpModelConfig(depth=0)          # ValueError: model.depth: must be >= 1, got 0
    TorchvisionModelConfig(name="resnet_nope").check_installed()
    # ValueError: model.name: not a torchvision classifier; one of [...]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models.checks import (
    check,
    check_choice,
    check_dropouts,
    check_fraction,
    check_min,
    check_stabilizers,
)

NORMS = ("layer", "batch", "none")
"""``model.norm``'s choices (``models.mlp.block``)."""


@dataclass
class MlpModelConfig:
    """``model=mlp``: the arguments of :func:`mlp`, checked up front."""

    _target_: str = "models.mlp.mlp"
    """Builder called with the other fields."""
    in_features: int = 16
    """Input width."""
    hidden: int = 64
    """Hidden width."""
    depth: int = 4
    """Hidden blocks; the Sequential has depth + 1 children (blocks and the head)."""
    classes: int = 8
    """Output classes."""
    dropout: float = 0.0
    """Dropout after each block."""
    norm: str = "layer"
    """``layer``, ``batch`` or ``none``."""

    def __post_init__(self) -> None:
        for key in ("in_features", "hidden", "depth", "classes"):
            check_min(getattr(self, key), 1, f"model.{key}")
        check_fraction(self.dropout, "model.dropout")
        check_choice(self.norm, NORMS, "model.norm")


@dataclass
class AmoebaNetModelConfig:
    """``model=amoebanet_d`` / ``amoebanet_b``: the arguments of :func:`amoebanet`, checked up
    front."""

    _target_: str = "models.amoebanet.amoebanet"
    """Builder called with the other fields."""
    genotype: str = "D"
    """``D`` (the paper's speed and size tables) or ``B`` (its ImageNet model)."""
    num_layers: int = 18
    """L, normal cells; a multiple of 3."""
    num_filters: int = 256
    """D, base filters; a multiple of 8."""
    num_classes: int = 1000
    """Classifier outputs (the option yaml takes it from data.num_classes)."""
    image_size: int = 224
    """Resolution the model is meant for (>= 32; the option yaml takes it from data.image_size)."""
    drop_path: float = 0.0
    """Probability of dropping a cell branch (TF AmoebaNet: keep 0.7, i.e. 0.3)."""
    bn_momentum: float | None = None
    """BatchNorm momentum in torch's sense (TF's decay 0.9997 is 0.0003); null: torch's 0.1."""
    bn_eps: float | None = None
    """BatchNorm epsilon (TF AmoebaNet: 1e-3); null: torch's 1e-5."""

    def __post_init__(self) -> None:
        check_choice(str(self.genotype).upper(), ("D", "B"), "model.genotype")
        check(
            self.num_layers >= 3 and self.num_layers % 3 == 0,
            "model.num_layers",
            f"must be a positive multiple of 3, got {self.num_layers}",
        )
        check(
            self.num_filters >= 8 and self.num_filters % 8 == 0,
            "model.num_filters",
            f"must be a positive multiple of 8, got {self.num_filters}",
        )
        check_min(self.num_classes, 1, "model.num_classes")
        check_min(self.image_size, 32, "model.image_size")
        check(
            0.0 <= self.drop_path < 1.0,
            "model.drop_path",
            f"must be in [0, 1), got {self.drop_path}",
        )
        if self.bn_momentum is not None:
            check(
                0.0 <= self.bn_momentum <= 1.0,
                "model.bn_momentum",
                f"must be in [0, 1], got {self.bn_momentum}",
            )
        if self.bn_eps is not None:
            check(self.bn_eps > 0, "model.bn_eps", f"must be > 0, got {self.bn_eps}")


@dataclass
class TransformerTModelConfig:
    """``model=transformer_t``: the arguments of :func:`transformer_t`, checked up front."""

    _target_: str = "models.transformer.transformer_t"
    """Builder called with the other fields."""
    num_layers: int = 6
    """L: encoder layers, and as many decoder layers (the Sequential has 2L + 2 children)."""
    ffn_dim: int = 8192
    """H: feed-forward width."""
    num_heads: int = 16
    """A: attention heads (attention width A * head_dim)."""
    d_model: int = 1024
    """Model dimension (1024 in the paper's multilingual models)."""
    head_dim: int = 64
    """Width of one attention head."""
    vocab_size: int = 64000
    """Output classes; the data's shared SentencePiece vocabulary must fit (data.vocab_size)."""
    max_len: int = 1024
    """Longest sequence (size of the position table)."""
    dropout: float = 0.1
    """Dropout on embeddings, residual branches and inside the feed-forward blocks."""
    attn_dropout: float = 0.0
    """Dropout on attention weights."""
    share_embeddings: bool = True
    """One token table for source and target."""
    tie_embeddings: bool = False
    """Reuse the token table as the softmax weight: one parameter in the first and the last
    child, which the engine does not support, so the runner rejects it (plain-model use only)."""
    ffn_init_scale: Any = None
    """Stabilizer 1: multiply feed-forward init by 1/L (``linear``), 1/sqrt(2L) (``sqrt``), a
    number, or null (off)."""
    logit_clip: float | None = None
    """Stabilizer 2: bound |logits| by this threshold (null: off)."""
    logit_clip_mode: str = "tanh"
    """``clamp`` (hard clip) or ``tanh`` (soft cap c * tanh(x / c))."""
    pad_id: int = 0
    """Padding token id (the data's SentencePiece uses 0)."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "ffn_dim", "num_heads", "d_model", "head_dim", "vocab_size"):
            check_min(getattr(self, key), 1, f"model.{key}")
        check_min(self.max_len, 2, "model.max_len")
        check_dropouts(self.dropout, self.attn_dropout)
        check(
            self.share_embeddings or not self.tie_embeddings,
            "model.tie_embeddings",
            "needs model.share_embeddings=true",
        )
        check_stabilizers(self.ffn_init_scale, self.logit_clip, self.logit_clip_mode)


@dataclass
class TransformerLMModelConfig:
    """``model=transformer_lm``: the arguments of :func:`transformer_lm`, checked up front."""

    _target_: str = "models.transformer_lm.transformer_lm"
    """Builder called with the other fields."""
    num_layers: int = 48
    """L: causal self-attention layers (Table 2 uses 48; Table 1 3 to 1663)."""
    d_model: int = 2048
    """Model dimension."""
    ffn_dim: int = 8192
    """Feed-forward width."""
    num_heads: int = 32
    """Attention heads; d_model must divide evenly."""
    vocab_size: int = 32000
    """Vocabulary (untied input embedding and softmax)."""
    max_len: int = 1024
    """Longest sequence (size of the position table)."""
    dropout: float = 0.0
    """Dropout on embeddings and residual branches."""
    attn_dropout: float = 0.0
    """Dropout on attention weights."""
    ffn_init_scale: Any = None
    """Feed-forward init scaling (``linear``, ``sqrt``, a number or null)."""
    logit_clip: float | None = None
    """Bound |logits| by this threshold (null: off)."""
    logit_clip_mode: str = "tanh"
    """``clamp`` or ``tanh``."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "d_model", "ffn_dim", "num_heads", "vocab_size", "max_len"):
            check_min(getattr(self, key), 1, f"model.{key}")
        check(
            self.d_model % self.num_heads == 0,
            "model.num_heads",
            f"must divide model.d_model ({self.d_model}), got {self.num_heads}",
        )
        check_dropouts(self.dropout, self.attn_dropout)
        check_stabilizers(self.ffn_init_scale, self.logit_clip, self.logit_clip_mode)


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


@dataclass
class HfCausalLmModelConfig:
    """``model=hf_causal_lm``: the arguments of :func:`hf_causal_lm`, checked up front."""

    _target_: str = "models.hf.hf_causal_lm"
    """Builder called with the other fields."""
    architecture: str = "llama"
    """Hugging Face model type that AutoModelForCausalLM builds: llama, mistral, qwen2, gpt2,
    gpt_neox, phi, gemma, mixtral, ... (``models.options.causal_lm_types()`` lists them); those
    of ``models.hf.cached_types()`` also generate (data.eval_samples, recipes/generate.py)."""
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
        check(
            self.architecture not in UNCAPTURABLE,
            "model.architecture",
            f"{self.architecture!r} cannot be captured: {UNCAPTURABLE.get(self.architecture)}",
        )
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

    def check_installed(self) -> None:
        """The rule that needs transformers (its list of model types), run once torch is
        imported; without transformers the builder says what to install."""
        try:
            types = causal_lm_types()
        except ImportError:
            return
        check(
            self.architecture in types,
            "model.architecture",
            f"{self.architecture!r} is not a model type AutoModelForCausalLM builds; one of "
            f"{', '.join(types[:12])}, ... (models.options.causal_lm_types() lists all "
            f"{len(types)})",
        )


def classification_models() -> list[str]:
    """Names torchvision lists as classification models (``torchvision.models.list_models``)."""
    import torchvision  # here: importing this module must not import torch

    return sorted(torchvision.models.list_models(module=torchvision.models))


@dataclass
class TorchvisionModelConfig:
    """``model=torchvision``: the arguments of :func:`torchvision_classifier`, checked up front."""

    _target_: str = "models.vision.torchvision_classifier"
    """Builder called with the other fields."""
    name: str = "resnet50"
    """A torchvision classification model (``torchvision.models.list_models()``)."""
    num_classes: int = 1000
    """Output classes (follows data.num_classes)."""
    image_size: int = 224
    """Image height and width (follows data.image_size; vit_* models are built for it)."""
    seed: int = 0
    """Seed of the random weights."""

    def __post_init__(self) -> None:
        check_min(self.num_classes, 1, "model.num_classes")
        check_min(self.image_size, 1, "model.image_size")

    def check_installed(self) -> None:
        """The rule that needs torchvision (its list of classifiers), run once torch is
        imported."""
        names = classification_models()
        check(self.name in names, "model.name", f"not a torchvision classifier; one of {names}")
