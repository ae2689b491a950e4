"""Bring your own model: any ``nn.Module`` captured as the flat ``nn.Sequential`` the engine cuts.

:func:`sequentialize` captures the forward with ``torch.export`` on example inputs and cuts the
graph at named submodules (or at every repeated block); whatever crosses a cut travels as the
tuple between pieces, and outputs, gradients and parameter names stay the model's. How the
pieces stay exact: docs/engine-internals.md#capture-pieces-that-stay-exact.

Its parts, one concept each (this package's own code is the door, :func:`sequentialize`):
:mod:`.graph`, the export graph prepared for cutting (:class:`CaptureError`); :mod:`.cuts`, where
to cut; :mod:`.pieces`, the cut and what crosses it; :mod:`.result`, the captured model
(:class:`Sequentialized`) and its original names; :mod:`.init`, a piece filled by its model's own
initialisation (a model built on meta). Example: :func:`sequentialize`'s.
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
