"""Checks of the model schemas' values, each a ``ValueError`` whose message starts with the key.

A model schema (a dataclass of ``models.options``, e.g. ``models.options.MlpModelConfig``)
checks its fields in ``__post_init__``, so a bad value stops a run before any work. Models import
nothing of giantpipe, so these raise a plain ``ValueError("model.KEY: problem")``; ``train.py``
shows it as the one line ``error: model.KEY: problem``, exactly like the library's own config
errors.

This module imports nothing, torch least of all: ``models.options`` imports it, and ``train.py``
imports ``models.options``, running every schema's ``__post_init__``, before it imports torch. A
rule shared by several schemas lives here (``check_dropouts``, ``check_stabilizers``).

Example::

    check_min(0, 1, "model.depth")      # ValueError: model.depth: must be >= 1, got 0
"""

from __future__ import annotations


def check(ok: bool, key: str, problem: str) -> None:
    """Raise ``ValueError(f"{key}: {problem}")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{key}: {problem}")


def check_min(value: float, low: float, key: str) -> None:
    """``value >= low``."""
    check(value >= low, key, f"must be >= {low}, got {value}")


def check_choice(value: object, choices: tuple[str, ...], key: str) -> None:
    """``value`` is one of ``choices``."""
    check(value in choices, key, f"must be one of {', '.join(choices)}; got {value!r}")


def check_fraction(value: float, key: str) -> None:
    """``0 <= value < 1`` (dropout rates)."""
    check(0.0 <= value < 1.0, key, f"must be in [0, 1), got {value}")


FFN_INIT_SCALES = ("sqrt", "linear")
"""``model.ffn_init_scale``'s names (else a positive number or null)."""
LOGIT_CLIP_MODES = ("tanh", "clamp")
"""``model.logit_clip_mode``'s choices."""


def check_stabilizers(ffn_init_scale: object, logit_clip: float | None, mode: str) -> None:
    """The schemas' check of the two stabilizers (``model.ffn_init_scale``, ``model.logit_clip``,
    ``model.logit_clip_mode``); a ValueError naming the key."""
    ok = ffn_init_scale is None or ffn_init_scale in FFN_INIT_SCALES
    ok = ok or (isinstance(ffn_init_scale, int | float) and ffn_init_scale > 0)
    check(ok, "model.ffn_init_scale", f"must be null, sqrt, linear or > 0; got {ffn_init_scale!r}")
    if logit_clip is not None:
        check(logit_clip > 0, "model.logit_clip", f"must be > 0 or null, got {logit_clip}")
    check_choice(mode, LOGIT_CLIP_MODES, "model.logit_clip_mode")


def check_dropouts(dropout: float, attn_dropout: float) -> None:
    """The schemas' check of ``model.dropout`` and ``model.attn_dropout``: both in [0, 1)."""
    check_fraction(dropout, "model.dropout")
    check_fraction(attn_dropout, "model.attn_dropout")
