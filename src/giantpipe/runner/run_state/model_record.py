"""What a checkpoint's manifest says of the model: its builder and, for a Hugging Face model,
its config (what ``python -m giantpipe.consolidate ... --format hf`` writes as ``config.json``).

Example::

    model_record(cfg.model, parts.model)   # {"target": "models.hf.hf_causal_lm", ...}
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from giantpipe.runner.registry import build_from_target
from giantpipe.runner.seeding import restore_rng, rng_state


def model_record(spec: Any, model: nn.Module | None) -> dict[str, Any]:
    """The model's builder (``_target_``) and, for a Hugging Face model, its config as JSON
    (what ``python -m giantpipe.consolidate ... --format hf`` writes as ``config.json``).

    Example::

        model_record(cfg.model, parts.model)   # {"target": "models.hf.hf_causal_lm", ...}
    """
    record: dict[str, Any] = {"target": str(getattr(spec, "_target_", ""))}
    config = hf_config(spec, model)
    if config is not None:
        record["hf_config"] = config
    return record


def hf_config(spec: Any, model: nn.Module | None) -> dict[str, Any] | None:
    """The Hugging Face config of the model ``spec`` builds, or None for any other model.

    The capture keeps the weights, not the Hugging Face module, so the builder runs again, on
    the meta device (no memory, no weights) and with the random generators put back after.
    A flat Sequential as built is never a Hugging Face model; nor is anything built where
    transformers was never imported.
    """
    if "transformers" not in sys.modules:
        return None
    if isinstance(model, nn.Sequential) and not hasattr(model, "original_names"):
        return None
    try:
        with _generators_kept(), torch.device("meta"):
            built = build_from_target(spec, "model")
    except Exception:  # noqa: BLE001 - a builder that needs real memory: no export as hf
        return None
    config: Any = getattr(built, "config", None)
    if not hasattr(config, "to_json_string") or not hasattr(built, "save_pretrained"):
        return None
    found: dict[str, Any] = json.loads(config.to_json_string())
    return found


@contextlib.contextmanager
def _generators_kept() -> Iterator[None]:
    saved = rng_state()
    try:
        yield
    finally:
        restore_rng(saved)
