"""One stage of generation: its layers and, per micro-batch, their key/value caches.

The model's children offer ``forward_cached(inputs, cache) -> (outputs, cache)``: cache None on
the first call (the prompt), then what they returned, with ``cache.reorder(index)``; the last
child returns logits whose last position scores the next token (``models.transformer_layers``
describes the convention). A micro-batch of prompts of unequal length reaches the first child
as ``(tokens, keep)`` (:mod:`.prompts`); the children carry the mask on. The engine knows
nothing else of the model.

A stage whose parameters are sharded over replicas (FSDP2's ``full``) is given ``hold``: each
layer's parameters gathered around its use and freed after it, one layer whole at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from giantpipe.engine.generate.decoding import Value

__all__ = ["Hold", "StageCaches", "check_cached"]

Hold = Callable[[nn.Module], AbstractContextManager[Any]]
"""layer -> a block inside which its parameters are whole (gathered, then freed after)."""


def _nothing(layer: nn.Module) -> AbstractContextManager[Any]:
    return nullcontext()


def check_cached(layers: Sequence[nn.Module]) -> None:
    """Every child must offer ``forward_cached``; a TypeError names the first that does not.

    >>> check_cached([nn.Linear(2, 2)])
    Traceback (most recent call last):
    ...
    TypeError: generation needs forward_cached(inputs, cache) on every child; Linear lacks it
    """
    for layer in layers:
        if callable(getattr(layer, "forward_cached", None)):
            continue
        if isinstance(layer, torch.fx.GraphModule):  # a piece cut by engine.capture
            # whoever built the model may have said why it gave no caches (models.hf does)
            why = getattr(layer, "no_cache_reason", None) or (
                "its model gave it none (a Hugging Face causal LM's pieces get theirs from "
                "models.hf.give_caches(model, list(seq), seq.spans))"
            )
            raise TypeError(
                "generation needs forward_cached(inputs, cache) on every child; a piece "
                f"captured by sequentialize has no key/value cache: {why}"
            )
        raise TypeError(
            "generation needs forward_cached(inputs, cache) on every child; "
            f"{type(layer).__name__} lacks it"
        )


def _to(value: Value, device: torch.device) -> Value:
    if isinstance(value, Tensor):
        return value.to(device)
    return tuple(_to(v, device) for v in value)


class StageCaches:
    """One stage's children and, per micro-batch, their caches; ``hold``: around each child's
    use (default: nothing to gather).

    Example::

        stage = StageCaches(list(model), torch.device("cpu"))
        logits = stage.run(0, (src, bos), None)               # the prompt: caches made
        logits = stage.run(0, next_tokens, order)             # one step: caches reordered, grown
        stage.drop(0)
    """

    def __init__(
        self, layers: Sequence[nn.Module], device: torch.device, hold: Hold | None = None
    ) -> None:
        check_cached(layers)
        self.layers, self.device = list(layers), device
        self.hold = hold or _nothing
        self.caches: dict[int, list[Any]] = {}

    def run(self, m: int, value: Value, order: Tensor | None) -> Value:
        caches = self.caches.get(m)
        if caches is None:
            caches = [None] * len(self.layers)
        elif order is not None:  # beams reordered, finished rows gone: in every layer's cache
            caches = [None if c is None else c.reorder(order) for c in caches]
        value = _to(value, self.device)
        for i, layer in enumerate(self.layers):
            with self.hold(layer):
                value, caches[i] = layer.forward_cached(value, caches[i])  # type: ignore[operator]
        self.caches[m] = caches
        return value

    def idle(self) -> None:
        """The gathers of a :meth:`run`, in its order, without computing anything: a step of a
        micro-batch done here that the replicas in lockstep still take."""
        for layer in self.layers:
            with self.hold(layer):
                pass

    def drop(self, m: int) -> None:
        self.caches.pop(m, None)
