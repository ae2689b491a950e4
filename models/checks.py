"""Checks of the model schemas' values, each a ``ValueError`` whose message starts with the key.

A model schema (the dataclass beside its builder, e.g. ``models.mlp.MlpModelConfig``) checks its
fields in ``__post_init__``, so a bad value stops a run before any work. Models import nothing of
giantpipe, so these raise a plain ``ValueError("model.KEY: problem")``; ``train.py`` shows it as
the one line ``error: model.KEY: problem``, exactly like the library's own config errors.

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
