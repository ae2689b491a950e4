"""Any torchvision classification model by name (``resnet50``, ``vit_b_16``, ...), random
weights. The builder returns torchvision's module itself; the runner (``giantpipe.runner.model``)
captures it as the flat Sequential the engine cuts, with ``giantpipe.sequentialize`` (pieces at
its repeated blocks: residual blocks, encoder layers). ``models.options.TorchvisionModelConfig``
is the schema of ``model=torchvision``.

Example::

    from models.vision import torchvision_classifier

    model = torchvision_classifier("vit_b_16", num_classes=10, image_size=32)
    model(torch.randn(2, 3, 32, 32)).shape       # (2, 10)
"""

from __future__ import annotations

import torch
import torchvision
from torch import nn


def torchvision_classifier(
    name: str = "resnet50", num_classes: int = 1000, image_size: int = 224, seed: int = 0
) -> nn.Module:
    """``torchvision.models.get_model(name)`` for ``num_classes`` classes, no weights loaded;
    vision transformers are built for ``image_size`` (others take any size)."""
    kwargs: dict[str, int] = {"num_classes": num_classes}
    if name.startswith("vit_"):
        kwargs["image_size"] = image_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = torchvision.models.get_model(name, weights=None, **kwargs)
    return model
