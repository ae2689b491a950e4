"""Bring your own model: any ``nn.Module`` captured as the flat ``nn.Sequential`` the engine cuts.

:func:`sequentialize` captures ``model``'s forward on example inputs with ``torch.export``
(non-strict: real Python runs, shapes stay symbolic, so batch and sequence sizes may change),
then cuts the graph into pieces at named submodules. Each piece is one child of the returned
Sequential; whatever crosses a cut (hidden states, attention masks, position ids, residual
branches, integer and bool tensors, sizes) travels as the tuple between children::

    model.forward                      Sequentialized
      embed -> h.0 -> h.1 -> head        [0: embed] -> [1: h.0] -> [2: h.1] -> [3: head]
      (input_ids, mask)                  (input_ids, mask) -> (hidden, mask, ...) -> logits

Exactness: a piece runs the captured aten ops in the original order, on the original parameter
objects, so outputs and every gradient equal the model's. What a graph cannot hold is kept as a
layer: BatchNorm and dropout-like modules stay modules (``.eval()`` switches them; the engine
seeds them, so re-materialization replays their masks), and any other random op (functional
dropout, attention dropout) becomes a :class:`RandomOp` layer.

Names: ``state_dict()`` of the Sequential, and of a pipe built on it, uses the model's own
parameter names (:class:`OriginalNames`), so checkpoints load into the plain model with
``strict=True`` and back. A parameter used on both sides of a cut (tied input and output
embeddings) is, by default, held by every piece that uses it (``tied="share"``): one object,
which the engine keeps tied across stages (a copy per device whose gradients it sums once a
step). ``tied="carry"`` instead holds it in its first piece and carries it along the pipeline
as a value (one tensor, but it crosses every cut each micro-batch, forward and backward);
``tied="error"`` refuses such a cut.

Example::

    seq = sequentialize(gpt2, input_ids=ids, split_points=["transformer.h.4", "transformer.h.8"])
    pipe = GPipe(seq, balance=[1, 1, 1], devices=["cpu"] * 3, chunks=4)
    out = seq.unflatten(pipe(seq.flatten(input_ids=ids)))     # CausalLMOutput, as gpt2's

Its parts, one concept each (this package's own code is the door, :func:`sequentialize`):

- :mod:`.result`: the captured model (:class:`Sequentialized`) and its original names;
- :mod:`.graph`: the export graph, captured and prepared for cutting (RandomOp layers,
  :class:`CaptureError`);
- :mod:`.cuts`: where to cut (split points, repeated blocks);
- :mod:`.pieces`: cutting the graph into pieces, and what crosses each cut;
- :mod:`.init`: a piece filled by its model's own initialisation (a model built on meta).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from giantpipe.engine.capture.cuts import _check_split_point, _cut_positions, _spans
from giantpipe.engine.capture.graph import (
    DYNAMIC,
    CaptureError,
    RandomOp,
    _export,
    _Graph,
    _with_defaults,
)
from giantpipe.engine.capture.pieces import _partition
from giantpipe.engine.capture.result import OriginalNames, Sequentialized

__all__ = ["CaptureError", "OriginalNames", "RandomOp", "Sequentialized", "sequentialize"]


def sequentialize(
    model: nn.Module,
    *example_args: Any,
    split_points: Sequence[str] | None = None,
    output: str | int | None = None,
    tied: str = "share",
    dynamic: str = "all",
    **example_kwargs: Any,
) -> Sequentialized:
    """``model`` as a flat Sequential whose forward equals ``model(*args, **kwargs)``.

    Args:
        model: any module whose forward torch.export can capture (no Python branches on
            tensor values).
        example_args, example_kwargs: a sample batch, batch size at least 2; every tensor's
            first dimension is the batch (micro-batches cut it).
        split_points: submodule names where a new piece starts, e.g. ``["layer2", "layer3"]``;
            default: every repeated block (children of a ModuleList / Sequential of one class:
            transformer layers, residual blocks) and the head after the last one.
        output: keep only this field of a dataclass / dict output (``"logits"``) or this
            position of a tuple output, so that the pipeline ends with one tensor.
        tied: a parameter used on both sides of a cut: ``"share"`` it between the pieces that
            use it (the engine keeps the stages' copies equal), ``"carry"`` it along the
            pipeline as a value, or ``"error"`` to refuse such a cut.
        dynamic: which input dimensions may differ from the example's in later calls:
            ``"all"`` (a sequence's length too), or ``"batch"`` alone, for inputs of one shape
            (images), which captures much faster.

    Example::

        seq = sequentialize(torchvision.models.resnet50(), torch.randn(2, 3, 224, 224))
        balance = balance_by_time(4, seq, x)                 # pieces: stem, 16 blocks, head
        y = seq(seq.flatten(x))                              # == resnet50(x)
    """
    if tied not in ("share", "carry", "error"):
        raise ValueError(f"tied must be 'share', 'carry' or 'error', got {tied!r}")
    if dynamic not in DYNAMIC:
        raise ValueError(f"dynamic must be 'all' or 'batch', got {dynamic!r}")
    for name in split_points or ():  # before the export: a wrong name fails at once
        _check_split_point(model, name)
    kwargs = _with_defaults(model, example_kwargs)
    program = _export(model, example_args, kwargs, dynamic)
    graph = _Graph(program, model)
    graph.keep_layers()
    graph.out_of_place()
    graph.select_output(output)
    cuts = _cut_positions(graph, model, split_points)
    pieces, carried = _partition(graph, cuts, tied)
    seq = Sequentialized(pieces, graph, (example_args, kwargs), set(kwargs) - set(example_kwargs))
    seq.spans = _spans(graph.nodes(), cuts)
    seq.train(model.training)
    return seq
