"""One layer of a model, made real on a device for measuring, the model left as it is.

A model built by :func:`~giantpipe.engine.meta.build_on_meta` has its parameters on
the meta device (no values) and its buffers real; its layer ``i`` is copied, given parameters
on the device and filled by ``init(i, layer)``. A layer with real parameters is copied to the
device. Measurements take the layers one at a time and drop each copy before the next, so no
more than one layer is held (docs/timing-and-planner.md, "Planning without the whole model").

Example::

    >>> from giantpipe.engine.meta import build_on_meta, seeded_init
    >>> model = build_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    >>> layer = layer_on(model, 0, torch.device("cpu"), seeded_init(0))
    >>> layer.weight.device.type, model[0].weight.device.type
    ('cpu', 'meta')
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from giantpipe.engine.meta import LayerInit, allocate_layers


def has_meta_parameters(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is on the meta device (it must be made real to run).

    >>> has_meta_parameters(nn.Linear(2, 2)), has_meta_parameters(nn.Linear(2, 2, device="meta"))
    (False, True)
    """
    return any(p.device.type == "meta" for p in module.parameters())


def layer_on(
    model: nn.Sequential, index: int, device: torch.device, init: LayerInit | None = None
) -> nn.Module:
    """A copy of ``model[index]`` on ``device`` with real values: meta parameters allocated
    there and set by ``init(index, copy)`` (required for them), real ones copied."""
    layer = model[index]
    if not has_meta_parameters(layer):
        return copy.deepcopy(layer).to(device)
    if init is None:
        raise ValueError(
            f"layer {index} ({type(layer).__name__}) has its parameters on the meta device: "
            "pass init, the LayerInit that fills a layer once it is allocated"
        )
    probe = nn.Sequential(copy.deepcopy(layer))  # meta parameters copy for free

    def fill(_: int, copied: nn.Module) -> None:
        init(index, copied)  # the index in the model, not in the one-layer probe

    allocate_layers(probe, [0], torch.device(device), fill)
    return probe[0]
