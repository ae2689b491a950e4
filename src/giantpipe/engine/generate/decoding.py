"""How the next token is chosen (:class:`Decoding`) and what travels the ring of stages
(:class:`Message`: ``(m, value, order)``, the rows each row continues; a ``ghost`` keeps a
replica in lockstep): docs/generation.md#inside-the-ring-and-its-messages.

Example::

    >>> Decoding(beam_size=4, eos_id=3).length_penalty
    0.6
    >>> Message(0, None).ghost
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["Decoding", "Message", "Tokens", "Value"]

Value = Any  # a tensor or a tuple of tensors (a stage boundary), or a token tensor [B, t]
Tokens = list[list[int]]  # per row of a micro-batch


@dataclass(frozen=True)
class Decoding:
    """How the next token is chosen. ``beam_size`` > 1: beam search; else ``temperature`` > 0
    samples (after ``top_k`` and ``top_p``), 0 takes the arg-max (greedy).

    ``eos_id`` ends a row (None: rows run ``steps`` tokens); ``pad_id`` tokens are dropped
    from the output (as the reference decoder in ``giantpipe.data.translation.decoding``
    does); ``seed`` makes sampling repeatable (micro-batch m draws from ``seed + m``).

    Example::

        Decoding(beam_size=4, length_penalty=0.6, eos_id=3, pad_id=0)   # translation
        Decoding(temperature=0.8, top_k=40, top_p=0.95, seed=1)         # a language model
    """

    beam_size: int = 1
    length_penalty: float = 0.6
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")
        if self.beam_size > 1 and self.temperature > 0:
            raise ValueError("choose beam search (beam_size > 1) or sampling (temperature > 0)")


@dataclass
class Message:
    """What travels the ring for micro-batch ``m``: a stage's output, or (to stage 0) the next
    tokens; ``value`` None: m is done. ``order``: rows of the previous step each row continues
    (None: every row, as it was).
    ``steps``: the most tokens m may generate (read by the last stage on m's first message).
    ``ghost``: a step without values (``value`` None), kept in lockstep with the replicas.
    ``stage``: the stage it goes to (a worker may hold several)."""

    m: int
    value: Value
    order: Tensor | None = None
    steps: int = 0
    ghost: bool = False
    stage: int = 0
