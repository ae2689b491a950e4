"""What each layer of a model costs per sample: FLOPs, parameters, and the bytes it keeps.

Measured, not guessed: the model runs one sample, layer by layer, on the meta device (no memory,
no arithmetic: shapes only) under ``torch.utils.flop_counter.FlopCounterMode`` for the FLOPs and
a saved-tensor hook for the bytes autograd would keep, the way
:class:`giantpipe.engine.stats.SavedTensorMeter` counts them on real tensors. Everything scales
linearly with the micro-batch size. Uneven layers come out as they are: an embedding with many
parameters and no FLOPs, a vocabulary head heavier than a Transformer layer, AmoebaNet's
reduction cells and its wide, low-resolution last cells.

Example::

    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> costs = measure_layers(model, torch.empty(1, 8, device="meta"))
    >>> [c.flops for c in costs], [c.params for c in costs]
    ([256.0, 0.0, 128.0], [144, 0, 68])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from giantpipe.engine.microbatch import as_tuple, nbytes


@dataclass(frozen=True)
class LayerCost:
    """One layer, one sample."""

    flops: float  # forward FLOPs (2 per multiply-add of matmuls and convolutions)
    params: int
    param_bytes: int
    input_bytes: int  # the layer's input: what a stage starting here receives and keeps
    saved_bytes: int  # what autograd saves in the forward, beyond the layer's input
    input_saved: int  # bytes of the input that autograd saves too (kept once per stage)
    output_bytes: int  # what crosses the boundary after this layer


def measure_layers(
    model: nn.Sequential, sample: Any, loss_saves_output: bool = True
) -> list[LayerCost]:
    """Per-layer costs of ``model`` for one sample (a tensor or tuple; batch size 1).

    Best run with the model and sample on the meta device. With ``loss_saves_output`` the last
    layer also keeps its output, as a cross-entropy loss on logits does (its log-softmax).
    """
    exclude = {_key(p) for p in model.parameters()}
    costs, x = [], sample
    for i, layer in enumerate(model):
        leaves = _leaves(x, first=i == 0)
        meter = _MetaMeter(exclude, ignore=[t for t in as_tuple(leaves) if torch.is_tensor(t)])
        with FlopCounterMode(display=False) as counter, meter:
            y = layer(leaves)
        params = list(layer.parameters())
        saved = meter.bytes
        if loss_saves_output and i == len(model) - 1:
            saved += nbytes(y)
        costs.append(
            LayerCost(
                flops=float(counter.get_total_flops()),
                params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                input_bytes=nbytes(leaves),
                saved_bytes=saved,
                input_saved=meter.input_bytes,
                output_bytes=nbytes(y),
            )
        )
        x = _detach(y)
    return costs


def _key(t: torch.Tensor) -> int:
    # A storage's identity; meta tensors have no data pointer, but their storages are distinct.
    return int(t.untyped_storage()._cdata)


class _MetaMeter:
    """Bytes of distinct storages autograd saves, parameters excluded; the inputs' own storages
    are reported apart (``input_bytes``). Works on meta tensors."""

    def __init__(self, exclude: set[int], ignore: Sequence[torch.Tensor]) -> None:
        self._exclude = exclude
        self._inputs = {_key(t): t.untyped_storage().nbytes() for t in ignore}
        self._seen: set[int] = set()
        self.bytes = 0
        self.input_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key not in self._exclude and key not in self._seen:
            self._seen.add(key)
            if key in self._inputs:
                self.input_bytes += self._inputs[key]
            else:
                self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> _MetaMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _leaves(x: Any, first: bool) -> Any:
    def leaf(t: Any) -> Any:
        if not torch.is_tensor(t):
            return t
        return t.detach().requires_grad_(t.is_floating_point() and not first)

    return leaf(x) if torch.is_tensor(x) else tuple(leaf(t) for t in x)


def _detach(y: Any) -> Any:
    return (
        y.detach()
        if torch.is_tensor(y)
        else tuple(t.detach() if torch.is_tensor(t) else t for t in y)
    )
