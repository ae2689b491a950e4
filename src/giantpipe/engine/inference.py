"""A pipe used as its whole model for inference: :class:`PipedModel`, what a data's whole-model
evaluation is given (``DataBundle.evaluate_model``; the protocol: docs/your-data.md).

Its forward runs through the pipe's stages, each process holding only its own, without
gradients and in eval mode (every module left in the mode it was in); the outputs reach every
process of the pipeline. ``generate`` decodes through the stages with their key/value caches
(:mod:`giantpipe.engine.generate`). A GPipe (one process), a DistributedPipe (under torchrun every
process makes the same calls in the same order: they are collective) or a plain Sequential.

Example::

    >>> model = PipedModel(nn.Sequential(nn.Linear(3, 2), nn.ReLU()))
    >>> model(torch.ones(4, 3)).shape
    torch.Size([4, 2])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from giantpipe.engine.generate import Decoding, evaluating, generate
from giantpipe.engine.generate.decoding import Tokens, Value

__all__ = ["PipedModel"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a decode step may wait for another worker, for a pipe that names no timeout."""


class PipedModel:
    """``pipe`` (a GPipe, a DistributedPipe or a plain Sequential) as its whole model, for
    inference: ``model(inputs)``, ``model.generate(...)``; ``model.pipe`` itself for more.

    Example::

        logits = model(tokens)                                   # every process: the outputs
        out = model.generate(split_rows(prompts, model.chunks), [16] * model.chunks, Decoding())
    """

    def __init__(self, pipe: nn.Module) -> None:
        self.pipe = pipe

    def __call__(self, inputs: Value) -> Value:
        return self.forward(inputs)

    def forward(self, inputs: Value) -> Value:
        """The outputs of ``inputs`` through every stage, on every process of the pipeline
        (under torchrun on the host; locally where the last stage is). ``inputs`` are read
        where stage 0 is."""
        pipe = self.pipe
        given = inputs if getattr(pipe, "needs_inputs", True) else None
        with torch.no_grad(), evaluating(pipe):
            outputs = pipe(given)
        share = getattr(pipe, "share_outputs", None)  # a pipe over processes hands them round
        return outputs if share is None else share(outputs)

    def generate(
        self,
        prompts: Sequence[Value] | None,
        steps: Sequence[int],
        decoding: Decoding,
        timeout: float | None = None,
    ) -> list[Tokens]:
        """:func:`giantpipe.engine.generate.generate` through the pipe: per micro-batch of
        ``prompts`` and row, the token ids, on every process of the pipeline."""
        wait = timeout or float(getattr(self.pipe, "timeout", DEFAULT_TIMEOUT))
        return generate(self.pipe, prompts, steps, decoding, timeout=wait)

    @property
    def chunks(self) -> int:
        """M, the pipe's micro-batches per mini-batch (1 for a plain module): as many
        micro-batches as prompts keep every stage busy."""
        return int(getattr(self.pipe, "chunks", 1))

    @property
    def replica(self) -> int:
        """This process's replica (0 without replicas)."""
        return int(getattr(self.pipe, "replica", 0))

    @property
    def replicas(self) -> int:
        """R, the replicas of the pipeline (each runs the calls its own processes make)."""
        return int(getattr(self.pipe, "replicas", 1))

    def __getattr__(self, name: str) -> Any:
        # A hook written for a whole plain model (e.g. an encoder-decoder's ``encode``): say
        # what it gets instead, since no process holds the whole model.
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}: a whole-model evaluation gets "
            "the model as the pipe runs it (model(inputs), model.generate(...), model.pipe; "
            "docs/your-data.md), since no process holds every layer"
        )
