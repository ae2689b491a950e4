"""The paper's models in every size, built on the meta device (shapes only, no memory).

- ``build``: the models the planner script and the Table 2 recipe know by name, each with a
  one-sample input (recipes/plan_pipeline.py, recipes/table2_throughput.py);
- ``AmoebaNetD``, ``TransformerL``: Table 1's model families, as the model-size search of
  :mod:`giantpipe.perf.sizing` takes them (a :class:`~giantpipe.perf.sizing.ModelFamily`: a
  template model whose layers every size repeats; recipes/table1_max_model_size.py).

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
import torch.nn.functional as F
from torch import nn

from giantpipe.perf.memory import Spec, StageLoss, TensorSpec
from models.amoebanet import amoebanetd
from models.transformer import transformer_lm


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
            raise ValueError(f"unknown model {name!r}; choose amoebanet-d or transformer-l")
    return model.train(), sample


class AmoebaNetD:
    """AmoebaNet-D (L, D) at ``image_size`` px; L a multiple of 3, at least 6.

    Template (9, D): stem, reduce1, reduce2, 3 normal cells, reduce3, 3 normal, reduce4,
    3 normal, classifier. The first two cells of a stack differ from the rest (their
    "previous" input comes from before the stack), the rest are identical.
    """

    name = "AmoebaNet-D"

    def __init__(self, batch: int = 128, image_size: int = 224, classes: int = 1000) -> None:
        self.batch, self.image_size, self.classes = batch, image_size, classes

    def build(self, layers: int, width: int) -> nn.Sequential:
        with torch.device("meta"):
            return amoebanetd(layers, width, self.classes, self.image_size)

    def template(self, width: int) -> nn.Sequential:
        return self.build(9, width)

    def expand(self, layers: int) -> list[int]:
        """Template index of each of the L + 6 layers.

        >>> AmoebaNetD().expand(12)
        [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 10, 11, 12, 13, 13, 14]
        """
        if layers < 6 or layers % 3:
            raise ValueError(f"AmoebaNet-D needs L a multiple of 3 and >= 6, got {layers}")
        more = layers // 3 - 2
        return [0, 1, 2, 3, 4, *[5] * more, 6, 7, 8, *[9] * more, 10, 11, 12, *[13] * more, 14]

    def input(self, micro: int) -> Spec:
        return TensorSpec((micro, 3, self.image_size, self.image_size), torch.float32)

    def loss(self, micro: int) -> StageLoss:
        return StageLoss(F.cross_entropy, TensorSpec((micro,), torch.long))

    def describe(self, layers: int, width: int) -> str:
        return f"({layers},{width})"


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of [B, T, V] logits against [B, T] ids."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class TransformerL:
    """Transformer-L of Table 1 (d_model 2048, FFN 8192, 32 heads, vocab 32k, 1024 tokens).

    There is one width; ``width`` is the model dimension, kept for the common interface.
    """

    name = "Transformer-L"

    def __init__(self, batch: int = 32, seq_len: int = 1024, d_model: int = 2048) -> None:
        self.batch, self.seq_len, self.d_model = batch, seq_len, d_model

    def build(self, layers: int, width: int) -> nn.Sequential:
        with torch.device("meta"):
            return transformer_lm(
                layers, d_model=width, ffn_dim=4 * width, num_heads=width // 64,
                max_len=self.seq_len,
            )  # fmt: skip

    def template(self, width: int) -> nn.Sequential:
        return self.build(1, width)

    def expand(self, layers: int) -> list[int]:
        """[embedding, L layers, softmax head]; ``TransformerL().expand(2) == [0, 1, 1, 2]``."""
        return [0, *[1] * layers, 2]

    def input(self, micro: int) -> Spec:
        return TensorSpec((micro, self.seq_len), torch.long)

    def loss(self, micro: int) -> StageLoss:
        return StageLoss(lm_loss, TensorSpec((micro, self.seq_len), torch.long))

    def describe(self, layers: int, width: int) -> str:
        return str(layers)
