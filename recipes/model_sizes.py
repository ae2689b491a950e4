"""The paper's models at full size, built on the meta device (shapes only, no memory).

``build`` gives the models the planner script and the Table 2 recipe know by name, each with a
one-sample input (recipes/plan_pipeline.py, recipes/table2_throughput.py).

Example::

    >>> model, sample = build("transformer-l", layers=3)
    >>> sum(p.numel() for p in model.parameters())
    282146816
    >>> sample.shape, sample.device.type
    (torch.Size([1, 1024]), 'meta')
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.amoebanet import amoebanetd
from models.transformer import transformer_lm

NAMES = ("amoebanet-d", "transformer-l")


def build(
    name: str,
    layers: int | None = None,
    filters: int = 256,
    image_size: int = 224,
    seq_len: int = 1024,
    num_classes: int = 1000,
) -> tuple[nn.Sequential, Any]:
    """``(model, sample)`` on the meta device, in training mode.

    amoebanet-d: AmoebaNet-D (L, D) = (``layers`` default 18, ``filters``) on
    ``image_size``-pixel images; transformer-l: Transformer-L with ``layers`` (default 48)
    decoder layers of the paper's sizes (model 2048, FFN 8192, 32 heads, 32k vocabulary) on
    ``seq_len`` tokens.
    """
    with torch.device("meta"):
        if name == "amoebanet-d":
            model = amoebanetd(layers or 18, filters, num_classes, image_size)
            sample: Any = torch.empty(1, 3, image_size, image_size)
        elif name == "transformer-l":
            model = transformer_lm(layers or 48, max_len=seq_len)
            sample = torch.zeros(1, seq_len, dtype=torch.long)
        else:
            raise ValueError(f"unknown model {name!r}; choose one of {list(NAMES)}")
    return model.train(), sample
