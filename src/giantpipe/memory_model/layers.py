"""Per-layer memory costs, and the stage peaks they predict for a balance.

The search over model sizes asks "does (L, D) fit?" hundreds of times; running the engine for
each would take hours. Instead each layer of a small template model is run once under fake
tensors (forward + backward, one micro-batch) and its costs are recorded; a model of any depth
repeats the template's layers (see ``search.py``). The prediction only steers the search: the
model finally reported is measured by running the engine (``stage.py``).

A stage that re-materializes ('always') holds, at its peak (the first backward)::

    resident   weights + gradients + optimizer slots of its layers
  + M x input  its boundary input, kept for every micro-batch
  + backward   one micro-batch's activations, recomputed through the whole stage, and the
               extra bytes of the backward: max over layers j of (saved by layers 1..j +
               transient of j), as later layers' activations are freed when j runs

Without re-materialization ('never') the other M - 1 micro-batches' activations are kept too.

Example::

    with FakeTensorMode():
        model = amoebanetd(9, 208)
    costs = profile_layers(model, TensorSpec((1, 3, 224, 224), torch.float32), loss)
    stage_peaks(costs, [5, 10], chunks=128, checkpoint="always")
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from giantpipe.memory_model.specs import Spec, make, make_grads, spec_bytes, spec_of
from giantpipe.memory_model.stage import StageLoss, as_fake
from giantpipe.memory_model.tracker import LiveBytes, storage_bytes
from giantpipe.perf.balance import solve_balance

# Copies of each parameter an optimizer keeps besides the weight and its gradient.
OPTIMIZER_SLOTS = {"rmsprop": 1, "sgd": 0, "adam": 2}


@dataclass(frozen=True)
class LayerCost:
    """Bytes one layer costs for one micro-batch (``params`` is a count)."""

    params: int
    resident: int  # weights, buffers, gradients, optimizer slots
    input: int  # its input as received from a previous device
    saved: int  # kept for backward by its forward, output included
    transient: int  # the most extra bytes during its backward (weight gradients exist)
    spec: Spec  # shape of its input (one micro-batch)


def profile_layers(
    model: nn.Sequential, spec: Spec, loss: StageLoss, optimizer: str = "rmsprop"
) -> list[LayerCost]:
    """Runs each layer of ``model`` (meta or fake) forward and backward on one micro-batch.

    ``spec`` is the model's input; the last layer includes ``loss``. Saved bytes come from one
    forward through the whole chain (an output that no later backward needs is freed there, as
    in a stage's recompute); transients from each layer's backward on fresh inputs.
    """
    slots = OPTIMIZER_SLOTS[optimizer]
    _, fake_mode = as_fake(model)  # in place
    with warnings.catch_warnings(), fake_mode, LiveBytes() as mem:
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        # Resident already: a view of a weight (``w.t()`` in a linear) allocates nothing.
        mem.track([*model.parameters(), *model.buffers()])
        specs, saved = _chain_forward(model, spec, mem, loss)
        costs = []
        for i, layer in enumerate(model):
            last = i == len(model) - 1
            transient = _backward_transient(layer, specs[i], mem, loss if last else None)
            weights = storage_bytes(layer.parameters())
            costs.append(
                LayerCost(
                    params=sum(p.numel() for p in layer.parameters()),
                    resident=weights * (2 + slots) + storage_bytes(layer.buffers()),
                    input=spec_bytes(specs[i]),
                    saved=saved[i],
                    transient=transient,
                    spec=specs[i],
                )
            )
    return costs


def _chain_forward(
    model: nn.Sequential, spec: Spec, mem: LiveBytes, loss: StageLoss
) -> tuple[list[Spec], list[int]]:
    """Input spec and growth of live bytes of each layer in one forward through ``model``."""
    specs: list[Spec] = []
    saved: list[int] = []
    h = make(spec)
    for i, layer in enumerate(model):
        specs.append(spec_of(h, grad=i > 0))
        before = mem.live
        h = layer(h)
        if i == len(model) - 1:
            h = loss.fn(h, make(loss.target))
        saved.append(mem.live - before)
    return specs, saved


def _backward_transient(
    layer: nn.Module, spec: Spec, mem: LiveBytes, loss: StageLoss | None
) -> int:
    """Most bytes a layer's backward adds beyond what is held when it starts.

    Weight gradients exist already (they do from a stage's second micro-batch on), so what
    is counted is the temporaries: activation gradients and the new gradient before it is
    accumulated.
    """
    params = list(layer.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    y = layer(make(spec))
    if loss is not None:
        y = loss.fn(y, make(loss.target))
    mem.reset_peak()
    start = mem.live
    tensors = [t for t in (y if isinstance(y, tuple) else (y,)) if t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, list(make_grads(spec_of(tuple(tensors)))))
    for p in params:
        p.grad = None
    return mem.peak - start


def stage_peaks(
    costs: Sequence[LayerCost], balance: Sequence[int], chunks: int, checkpoint: str
) -> list[int]:
    """Predicted peak bytes of each stage (see the module docstring for the sum)."""
    peaks, start = [], 0
    for count in balance:
        layers = costs[start : start + count]
        others = 0 if checkpoint != "never" else (chunks - 1) * sum(c.saved for c in layers)
        peaks.append(
            sum(c.resident for c in layers)
            + chunks * layers[0].input
            + others
            + _backward_peak(layers)
        )
        start += count
    return peaks


def _backward_peak(layers: Sequence[LayerCost]) -> int:
    # Backward walks the stage from its last layer to its first; while layer j runs backward,
    # the later layers' saved tensors are already freed, the earlier ones' still held.
    held, peak = 0, 0
    for c in layers:
        held += c.saved
        peak = max(peak, held + c.transient)
    return peak


def balance_memory(
    costs: Sequence[LayerCost], partitions: int, chunks: int, checkpoint: str
) -> list[int]:
    """A balance minimising the predicted largest stage peak, cut by ``solve_balance``.

    A stage's peak is not a sum of per-layer costs (its first layer's input is stored M
    times), so two additive costs are tried: resident + saved, and the same plus M x input
    (as if any layer could start a stage); the balance with the lower predicted peak wins.
    """
    base = [max(0, c.resident + c.saved) for c in costs]  # a layer may free more than it saves
    candidates = [solve_balance(base, partitions)]
    if len({c.input for c in costs[1:]}) > 1:  # equal inputs add the same to every cut
        with_inputs = [b + chunks * c.input for b, c in zip(base, costs)]
        candidates.append(solve_balance(with_inputs, partitions))
    return min(candidates, key=lambda b: max(stage_peaks(costs, b, chunks, checkpoint)))


__all__ = ["LayerCost", "balance_memory", "profile_layers", "stage_peaks"]
