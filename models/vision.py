"""Any torchvision classification model by name (``resnet50``, ``vit_b_16``, ...), random
weights. The builder returns torchvision's module itself; the runner (``giantpipe.runner.build``)
captures it as the flat Sequential the engine cuts, with ``giantpipe.sequentialize`` (pieces at
its repeated blocks: residual blocks, encoder layers). :class:`TorchvisionModelConfig` is the
schema of ``model=torchvision``.

Example::

    from models.vision import torchvision_classifier

    model = torchvision_classifier("vit_b_16", num_classes=10, image_size=32)
    model(torch.randn(2, 3, 32, 32)).shape       # (2, 10)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision
from torch import nn

from models.checks import check, check_min


def classification_models() -> list[str]:
    """Names torchvision lists as classification models (``torchvision.models.list_models``)."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


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


@dataclass
class TorchvisionModelConfig:
    """``model=torchvision``: the arguments of :func:`torchvision_classifier`, checked up front."""

    _target_: str = "models.vision.torchvision_classifier"
    """Builder called with the other fields."""
    name: str = "resnet50"
    """A torchvision classification model (``torchvision.models.list_models()``)."""
    num_classes: int = 1000
    """Output classes (follows data.num_classes)."""
    image_size: int = 224
    """Image height and width (follows data.image_size; vit_* models are built for it)."""
    seed: int = 0
    """Seed of the random weights."""

    def __post_init__(self) -> None:
        check_min(self.num_classes, 1, "model.num_classes")
        check_min(self.image_size, 1, "model.image_size")
        # Last: it needs torchvision, which the command line imports only after the rules above.
        names = classification_models()
        check(self.name in names, "model.name", f"not a torchvision classifier; one of {names}")
