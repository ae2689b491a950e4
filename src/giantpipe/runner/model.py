"""The model from its config: flat, built on meta (or whole on the host), with its layers' init.

``pipeline.build=meta`` builds it with its parameters on the meta device; each pipe makes real
only the layers it holds, layer ``i`` filled by the model's own init under (``trainer.seed``,
``i``): a Sequential's ``giantpipe_init_layer(index, layer)``, a captured model's
``giantpipe_init_module(model, module)``, else each module's ``reset_parameters()``.
``pipeline.build=host`` builds it whole as its constructor does (docs/engine.md).

Example::

    model = build_model(cfg, bundle)
    model.layers, model.init    # the flat Sequential on meta; what fills layer i
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.data.bundle import DataBundle
from giantpipe.engine.capture import CaptureError, Sequentialized, sequentialize
from giantpipe.engine.capture.init import piece_init, reset_module
from giantpipe.engine.generate.caches import check_cached
from giantpipe.engine.meta import LayerInit, build_on_meta, reset_parameters, seeded
from giantpipe.engine.microbatch import as_tuple
from giantpipe.runner.registry import build_from_target


@dataclass(frozen=True)
class Model:
    """The model as a run holds it before any pipe: its layers and what fills them."""

    layers: nn.Sequential
    """The flat Sequential the engine cuts (under ``pipeline.build=meta``, on meta)."""
    init: LayerInit | None
    """``init(i, layer)``: layer ``i``'s values (the model's own init, seeded by (trainer.seed,
    ``i``)); None when the layers are real already (``pipeline.build=host``)."""


def build_model(cfg: ExperimentConfig, bundle: DataBundle | None = None) -> Model:
    """The model from its ``_target_`` as ``pipeline.build`` says: a flat, non-empty Sequential
    as built, or any other module captured as one (:func:`capture_model`, on a sample of
    ``bundle``'s training data), checked against the data's evaluation
    (:func:`check_generates`)."""
    model = _construct(cfg)
    if isinstance(model, nn.Sequential) and not isinstance(model, Sequentialized):
        if len(model) == 0:
            raise ConfigError("model._target_", "must build a non-empty nn.Sequential")
        if cfg.pipeline.split_points is not None:
            raise ConfigError(
                "pipeline.split_points",
                "the model is a flat nn.Sequential already (its children are the pieces); "
                "leave split_points null",
            )
        layers = model
    elif not isinstance(model, nn.Module):
        raise ConfigError("model._target_", "must build an nn.Module")
    elif bundle is None:
        raise ValueError(f"{type(model).__name__} is captured on a sample of its data: pass bundle")
    else:
        layers = capture_model(model, cfg, bundle)
    if bundle is not None:
        check_generates(cfg, bundle, layers)
    if cfg.pipeline.build == "host":
        return Model(layers, None)
    own = getattr(layers, "giantpipe_init_layer", reset_parameters)
    return Model(layers, seeded(own, cfg.trainer.seed))


def _construct(cfg: ExperimentConfig) -> Any:
    """The builder's module: on meta, where a failure that the meta device causes names the key
    that builds on the host instead."""
    if cfg.pipeline.build == "host":
        return build_from_target(cfg.model, "model")
    try:
        return build_on_meta(lambda: build_from_target(cfg.model, "model"))
    except (RuntimeError, NotImplementedError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if "meta" not in reason.lower():
            raise
        raise ConfigError(
            "pipeline.build",
            f"the model cannot be built without its parameters ({reason}); "
            "pipeline.build=host builds it whole on each process's host",
        ) from err


def check_generates(cfg: ExperimentConfig, bundle: DataBundle, model: nn.Sequential) -> None:
    """An evaluation that decodes through the pipe (held-out BLEU, LM samples) needs a model
    whose children can keep key/value caches: refused up front, naming the key that asked."""
    hook = bundle.evaluate_model
    if not getattr(hook, "generates", False):
        return
    try:
        check_cached(list(model))
    except TypeError as err:
        arch = getattr(cfg.model, "architecture", None)
        named = f"model {arch!r}: " if arch else ""
        raise ConfigError(getattr(hook, "config_key", "model._target_"), named + str(err)) from err


def capture_model(model: nn.Module, cfg: ExperimentConfig, bundle: DataBundle) -> nn.Sequential:
    """``model`` (e.g. a Hugging Face or torchvision module) as the flat Sequential the engine
    cuts: :func:`capture` on two samples of the first training batch (on the model's device:
    meta, when built there), at ``pipeline.split_points``, ending with ``pipeline.output``.

    Example::

        seq = capture_model(hf_causal_lm("llama", layers=4), cfg, bundle)   # 6 pieces
    """
    inputs, _ = bundle.first_batch(cfg.trainer.seed)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    sample = tuple(t[:2].to(device) if isinstance(t, torch.Tensor) else t for t in as_tuple(inputs))
    dynamic = "batch" if bundle.fixed_shape else "all"
    return capture(model, sample, cfg.pipeline.split_points, cfg.pipeline.output, dynamic)


def capture(
    model: nn.Module,
    sample: tuple[Any, ...],
    split_points: Any,
    output: str | None,
    dynamic: str = "all",
) -> nn.Sequential:
    """:func:`giantpipe.sequentialize` of ``model`` on ``sample`` (its positional inputs), with
    its pieces' key/value caches when the model offers them and its own init per piece as the
    Sequential's ``giantpipe_init_layer``; it must end with one tensor, the output the loss
    takes. Errors name the config key (``pipeline.split_points``, ``pipeline.output``,
    ``model._target_``). ``recipes/generate.py`` captures a saved run's model with it.

    Example::

        seq = capture(hf_causal_lm("llama", layers=2), (torch.zeros(2, 8, dtype=torch.long),),
                      None, "logits")                                    # 4 pieces
    """
    try:
        seq = sequentialize(
            model, *sample, split_points=split_points, output=output, dynamic=dynamic
        )
    except CaptureError as err:
        key = {"split_points": "pipeline.split_points", "output": "pipeline.output"}
        raise ConfigError(key.get(err.about, "model._target_"), str(err)) from err
    if seq.out_spec.num_leaves != 1:
        raise ConfigError(
            "pipeline.output",
            f"the model returns {seq.out_spec.num_leaves} values ({seq.out_spec.type}); name "
            "the one the loss takes, e.g. pipeline.output=logits",
        )
    # A model may give its pieces key/value caches for generation (models.hf's builder offers
    # it): called with the model while it is still whole, it keeps only each piece's own parts.
    cache_pieces = getattr(model, "giantpipe_cache_pieces", None)
    if callable(cache_pieces):
        cache_pieces(model, list(seq), seq.spans)
    init_module = getattr(model, "giantpipe_init_module", reset_module)
    setattr(seq, "giantpipe_init_layer", piece_init(model, init_module))  # noqa: B010
    return seq
