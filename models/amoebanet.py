"""AmoebaNet-D and AmoebaNet-B as one flat ``nn.Sequential`` of L + 6 layers.

A stem, four reduction cells, three stacks of L/3 normal cells and a classifier, every child
between stem and classifier taking and returning a (current, previous) pair, so any cut is a
valid boundary; torchgpipe's benchmark model, with its two departures from the TF reference
undone (layout and why: docs/paper-tables.md#amoebanet-d-and-amoebanet-b).

Example::

    import torch
    from models.amoebanet import amoebanetd

    model = amoebanetd(num_layers=3, num_filters=16, num_classes=10)
    logits = model(torch.randn(2, 3, 64, 64))      # (2, 10)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

__all__ = [
    "AMOEBANET_B",
    "AMOEBANET_D",
    "CellSpec",
    "Classifier",
    "Cell",
    "DropPath",
    "FactorizedReduce",
    "Genotype",
    "Stem",
    "amoebanet",
    "amoebanetb",
    "amoebanetd",
    "get_genotype",
    "set_batch_norm",
]

Pair = tuple[Tensor, Tensor]
ModuleT = TypeVar("ModuleT", bound=nn.Module)
Branch = tuple[str, int]  # (op name, index of the input state)


# --------------------------------------------------------------------------------------------
# Operations. Each is built by ``OPS[name](channels, stride)`` and maps C -> C channels.
# --------------------------------------------------------------------------------------------


class ReLUConvBN(nn.Sequential):
    """ReLU, bias-free convolution, BatchNorm.

    Example::

        op = ReLUConvBN(16, 32, kernel_size=1)
        y = op(torch.randn(2, 16, 8, 8))           # (2, 32, 8, 8)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int] = 1,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__(
            nn.ReLU(inplace=False),
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False),
            nn.BatchNorm2d(out_channels),
        )


class FactorizedReduce(nn.Module):
    """Halves the resolution without dropping pixels: two stride-2 1x1 convolutions, the second
    on the input shifted by one pixel, concatenated, then BatchNorm.

    Example::

        op = FactorizedReduce(16, 32)
        y = op(torch.randn(2, 16, 9, 9))           # (2, 32, 5, 5)
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if out_channels % 2:
            raise ValueError(f"FactorizedReduce needs an even out_channels, got {out_channels}")
        self.relu = nn.ReLU(inplace=False)
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.conv1 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.conv2 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        shifted = self.pad(x[:, :, 1:, 1:])
        return self.bn(torch.cat([self.conv1(x), self.conv2(shifted)], dim=1))


class Bottleneck(nn.Sequential):
    """ReLU-1x1 to C/4-BN, then the given spatial convolutions on C/4 (each ReLU-conv-BN),
    then ReLU-1x1 back to C-BN. ``kernels`` lists (kh, kw) of the spatial convolutions; the
    stride is applied along the matching axis only.

    Example::

        op = Bottleneck(32, stride=2, kernels=[(1, 7), (7, 1)])   # AmoebaNet's conv_1x7_7x1
        y = op(torch.randn(2, 32, 8, 8))                          # (2, 32, 4, 4)
    """

    def __init__(self, channels: int, stride: int, kernels: list[tuple[int, int]]) -> None:
        inner = channels // 4
        layers: list[nn.Module] = [ReLUConvBN(channels, inner)]
        for kh, kw in kernels:
            conv_stride = (stride if kh > 1 else 1, stride if kw > 1 else 1)
            layers.append(ReLUConvBN(inner, inner, (kh, kw), conv_stride, (kh // 2, kw // 2)))
        layers.append(ReLUConvBN(inner, channels))
        super().__init__(*layers)


class SepConv(nn.Sequential):
    """Stacked separable convolution (NASNet / TF AmoebaNet): ``repeats`` times ReLU, depthwise
    k x k (dilated, strided on the first repeat only), pointwise 1x1, BatchNorm.

    Example::

        op = SepConv(32, kernel_size=5, stride=2, dilation=2)
        y = op(torch.randn(2, 32, 8, 8))                          # (2, 32, 4, 4)
    """

    def __init__(
        self, channels: int, kernel_size: int, stride: int, dilation: int = 1, repeats: int = 2
    ) -> None:
        padding = dilation * (kernel_size - 1) // 2
        layers: list[nn.Module] = []
        for i in range(repeats):
            layers += [
                nn.ReLU(inplace=False),
                nn.Conv2d(
                    channels,
                    channels,
                    kernel_size,
                    stride=stride if i == 0 else 1,
                    padding=padding,
                    dilation=dilation,
                    groups=channels,
                    bias=False,
                ),
                nn.Conv2d(channels, channels, 1, bias=False),
                nn.BatchNorm2d(channels),
            ]
        super().__init__(*layers)


def _none(channels: int, stride: int) -> nn.Module:
    return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)


def _max_pool_2x2(channels: int, stride: int) -> nn.Module:
    # ceil_mode: odd sizes give ceil(H / 2) like every other stride-2 op ("SAME" in TF).
    return nn.MaxPool2d(2, stride=stride, padding=0, ceil_mode=True)


def _max_pool_3x3(channels: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(3, stride=stride, padding=1)


def _avg_pool_3x3(channels: int, stride: int) -> nn.Module:
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


def _conv_1x1(channels: int, stride: int) -> nn.Module:
    return ReLUConvBN(channels, channels, 1, stride)


def _conv_3x3(channels: int, stride: int) -> nn.Module:
    return Bottleneck(channels, stride, [(3, 3)])


def _conv_1x7_7x1(channels: int, stride: int) -> nn.Module:
    return Bottleneck(channels, stride, [(1, 7), (7, 1)])


def _sep_conv_3x3(channels: int, stride: int) -> nn.Module:
    return SepConv(channels, 3, stride)


def _sep_conv_5x5_dil2(channels: int, stride: int) -> nn.Module:
    return SepConv(channels, 5, stride, dilation=2)


OPS: dict[str, Callable[[int, int], nn.Module]] = {
    "none": _none,
    "max_pool_2x2": _max_pool_2x2,
    "max_pool_3x3": _max_pool_3x3,
    "avg_pool_3x3": _avg_pool_3x3,
    "conv_1x1": _conv_1x1,
    "conv_3x3": _conv_3x3,
    "conv_1x7_7x1": _conv_1x7_7x1,
    "sep_conv_3x3": _sep_conv_3x3,
    "sep_conv_5x5_dil2": _sep_conv_5x5_dil2,
}


class DropPath(nn.Module):
    """Drops a whole branch per example with probability ``p`` in training and rescales the
    kept ones by 1 / (1 - p); identity in eval mode or when p == 0. Uses the global RNG, so a
    pipeline engine that recomputes forward passes must replay the RNG state of this layer.

    Example::

        drop = DropPath(0.3).train()
        y = drop(torch.ones(4, 8, 2, 2))           # each example all 0 or all 1 / 0.7
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"DropPath probability must be in [0, 1), got {p}")
        self.p = p

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = torch.empty(x.shape[0], *([1] * (x.dim() - 1)), device=x.device, dtype=x.dtype)
        return x * mask.bernoulli_(keep) / keep


# --------------------------------------------------------------------------------------------
# Genotypes (TF reference model_specs.py). A step adds two ops applied to earlier states:
# states 0 (current) and 1 (previous) are the cell inputs; step k produces state k + 2.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CellSpec:
    """One cell type: each of the five ``steps`` is two (op name, input state) branches whose
    sum becomes the next state; the cell outputs the channel concatenation of ``concat``."""

    steps: tuple[tuple[Branch, Branch], ...]
    concat: tuple[int, ...]

    @property
    def ops(self) -> list[Branch]:
        """The branches of all steps in order: step k is ``ops[2k]`` + ``ops[2k + 1]``."""
        return [branch for step in self.steps for branch in step]


@dataclass(frozen=True)
class Genotype:
    """A normal cell and a reduction cell, as found by the AmoebaNet evolution."""

    name: str
    normal: CellSpec
    reduction: CellSpec


AMOEBANET_D = Genotype(
    name="amoebanet_d",
    normal=CellSpec(
        steps=(
            (("conv_1x1", 1), ("max_pool_3x3", 1)),  # state 2
            (("none", 1), ("conv_1x7_7x1", 0)),  # state 3
            (("conv_1x1", 0), ("conv_1x7_7x1", 0)),  # state 4
            (("max_pool_3x3", 2), ("none", 2)),  # state 5
            (("avg_pool_3x3", 1), ("conv_1x1", 5)),  # state 6
        ),
        concat=(0, 3, 4, 6),
    ),
    reduction=CellSpec(
        steps=(
            (("max_pool_2x2", 0), ("max_pool_3x3", 0)),
            (("none", 2), ("conv_3x3", 1)),
            (("conv_1x7_7x1", 2), ("max_pool_3x3", 2)),
            (("none", 3), ("max_pool_2x2", 1)),
            (("avg_pool_3x3", 2), ("conv_1x1", 3)),
        ),
        concat=(4, 5, 6),
    ),
)

AMOEBANET_B = Genotype(
    name="amoebanet_b",
    normal=CellSpec(
        steps=(
            (("conv_1x1", 1), ("max_pool_3x3", 1)),
            (("none", 1), ("sep_conv_3x3", 0)),
            (("conv_1x1", 1), ("sep_conv_3x3", 0)),
            (("conv_1x1", 2), ("none", 2)),
            (("avg_pool_3x3", 1), ("conv_1x1", 5)),
        ),
        concat=(0, 3, 4, 6),
    ),
    reduction=CellSpec(
        steps=(
            (("max_pool_2x2", 0), ("max_pool_3x3", 0)),
            (("none", 2), ("conv_3x3", 1)),
            (("sep_conv_5x5_dil2", 2), ("max_pool_3x3", 2)),
            (("none", 3), ("sep_conv_3x3", 1)),
            (("avg_pool_3x3", 4), ("conv_1x1", 3)),
        ),
        concat=(5, 6),
    ),
)

GENOTYPES: dict[str, Genotype] = {"d": AMOEBANET_D, "b": AMOEBANET_B}


def get_genotype(name: str) -> Genotype:
    """Looks a genotype up by name: "D", "B", "amoebanet_d", "AmoebaNet-B", ...

    Example::

        assert get_genotype("AmoebaNet-D") is AMOEBANET_D
    """
    key = name.lower().replace("-", "_").removeprefix("amoebanet").lstrip("_")
    if key not in GENOTYPES:
        raise ValueError(f"unknown AmoebaNet genotype {name!r}; expected one of 'D', 'B'")
    return GENOTYPES[key]


# --------------------------------------------------------------------------------------------
# Layers of the flat Sequential.
# --------------------------------------------------------------------------------------------


class Stem(nn.Module):
    """3x3 stride-2 convolution and BatchNorm on the image; returns the pair (x, x).

    Example::

        stem = Stem(8)
        cur, prev = stem(torch.randn(2, 3, 32, 32))   # both (2, 8, 16, 16)
    """

    def __init__(self, channels: int, in_channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, image: Tensor) -> Pair:
        x = self.bn(self.conv(image))
        return x, x


class Cell(nn.Module):
    """One AmoebaNet cell: (current, previous) -> (output, current).

    State 0 is current through ReLU-1x1-BN to C channels; state 1 is previous, factorized-reduced
    if the previous cell halved the resolution (``reduction_prev``), else ReLU-1x1-BN if its
    width differs from C, else unchanged. In a reduction cell, ops reading state 0 or 1 use
    stride 2. The output has ``C * len(spec.concat)`` channels.

    Example::

        cell = Cell(AMOEBANET_D.normal, prev_prev=32, prev=32, channels=16,
                    reduction=False, reduction_prev=False)
        out, cur = cell((torch.randn(2, 32, 8, 8), torch.randn(2, 32, 8, 8)))  # out: 64 ch
    """

    def __init__(
        self,
        spec: CellSpec,
        prev_prev: int,
        prev: int,
        channels: int,
        reduction: bool,
        reduction_prev: bool,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.preprocess0 = ReLUConvBN(prev, channels)
        self.preprocess1: nn.Module = nn.Identity()
        if reduction_prev:
            self.preprocess1 = FactorizedReduce(prev_prev, channels)
        elif prev_prev != channels:
            self.preprocess1 = ReLUConvBN(prev_prev, channels)
        self.inputs = [index for _, index in spec.ops]
        self.concat = list(spec.concat)
        self.ops = nn.ModuleList(
            OPS[name](channels, 2 if reduction and index < 2 else 1) for name, index in spec.ops
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0 else None
        self.out_channels = channels * len(self.concat)

    def extra_repr(self) -> str:
        return f"inputs={self.inputs}, concat={self.concat}"

    def _branch(self, i: int, states: list[Tensor]) -> Tensor:
        op = self.ops[i]
        y = op(states[self.inputs[i]])
        if self.drop_path is not None and not isinstance(op, nn.Identity):
            y = self.drop_path(y)
        return y

    def forward(self, pair: Pair) -> Pair:
        current, previous = pair
        states = [self.preprocess0(current), self.preprocess1(previous)]
        for i in range(0, len(self.ops), 2):
            states.append(self._branch(i, states) + self._branch(i + 1, states))
        return torch.cat([states[i] for i in self.concat], dim=1), current


class Classifier(nn.Module):
    """Global average pool of the current tensor, flatten, Linear.

    Example::

        head = Classifier(64, num_classes=10)
        logits = head((torch.randn(2, 64, 7, 7), torch.randn(2, 32, 7, 7)))   # (2, 10)
    """

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, pair: Pair) -> Tensor:
        current, _ = pair
        return self.fc(self.flatten(self.pool(current)))


# --------------------------------------------------------------------------------------------
# Builders.
# --------------------------------------------------------------------------------------------


@dataclass
class _Widths:
    """Channel bookkeeping while cells are stacked."""

    prev_prev: int
    prev: int
    reduction_prev: bool = False


def _cells(
    genotype: Genotype,
    widths: _Widths,
    channels: int,
    count: int,
    reduction: bool,
    drop_path: float,
) -> Iterator[Cell]:
    spec = genotype.reduction if reduction else genotype.normal
    for _ in range(count):
        cell = Cell(
            spec,
            widths.prev_prev,
            widths.prev,
            channels,
            reduction,
            widths.reduction_prev,
            drop_path,
        )
        widths.prev_prev, widths.prev = widths.prev, cell.out_channels
        widths.reduction_prev = reduction
        yield cell


def _check_args(num_layers: int, num_filters: int, num_classes: int, image_size: int) -> None:
    if num_layers < 3 or num_layers % 3:
        raise ValueError(f"num_layers must be a positive multiple of 3, got {num_layers}")
    if num_filters < 8 or num_filters % 8:
        raise ValueError(f"num_filters must be a positive multiple of 8, got {num_filters}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    if image_size < 32:
        raise ValueError(f"image_size must be at least 32 (five stride-2 stages), got {image_size}")


def amoebanet(
    genotype: str,
    num_layers: int,
    num_filters: int,
    num_classes: int = 1000,
    image_size: int = 224,
    drop_path: float = 0.0,
    bn_momentum: float | None = None,
    bn_eps: float | None = None,
) -> nn.Sequential:
    """Builds AmoebaNet-``genotype`` (L, D) = (num_layers, num_filters) as a flat Sequential of
    num_layers + 6 children. ``image_size`` is the resolution the model is meant for (checked
    to be >= 32); global average pooling lets any input size run. ``drop_path`` > 0 adds
    :class:`DropPath` after every non-identity op of every cell (none by default).
    ``bn_momentum`` / ``bn_eps`` set every BatchNorm (None: torch's 0.1 / 1e-5); TF's BN decay
    0.9997 is ``bn_momentum=0.0003`` (torch's momentum is the weight of the NEW statistic).

    Example::

        with torch.device("meta"):                       # count without allocating
            model = amoebanet("D", num_layers=18, num_filters=208)
        assert sum(p.numel() for p in model.parameters()) == 81_505_540
    """
    _check_args(num_layers, num_filters, num_classes, image_size)
    geno = get_genotype(genotype)
    repeat = num_layers // 3
    d = num_filters
    widths = _Widths(prev_prev=d // 4, prev=d // 4)

    def reduce(channels: int) -> Cell:
        return next(_cells(geno, widths, channels, 1, True, drop_path))

    def normals(stack: int, channels: int) -> Iterator[tuple[str, Cell]]:
        cells = _cells(geno, widths, channels, repeat, False, drop_path)
        return ((f"normal{stack}_{i + 1}", cell) for i, cell in enumerate(cells))

    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["stem"] = Stem(d // 4)
    layers["reduce1"] = reduce(d // 2)
    layers["reduce2"] = reduce(d)
    layers.update(normals(1, d))
    layers["reduce3"] = reduce(2 * d)
    layers.update(normals(2, 2 * d))
    layers["reduce4"] = reduce(4 * d)
    layers.update(normals(3, 4 * d))
    layers["classifier"] = Classifier(widths.prev, num_classes)
    return set_batch_norm(nn.Sequential(layers), bn_momentum, bn_eps)


def set_batch_norm(model: ModuleT, momentum: float | None, eps: float | None) -> ModuleT:
    """Sets momentum and/or eps of every BatchNorm in ``model`` (None leaves it); returns it.

    Example::

        model = set_batch_norm(amoebanetd(3, 16), momentum=0.0003, eps=1e-3)   # TF's BN
    """
    if momentum is not None and not 0.0 <= momentum <= 1.0:
        raise ValueError(f"bn_momentum must be in [0, 1], got {momentum}")
    if eps is not None and eps <= 0.0:
        raise ValueError(f"bn_eps must be > 0, got {eps}")
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = module.momentum if momentum is None else momentum
            module.eps = module.eps if eps is None else eps
    return model


def amoebanetd(
    num_layers: int = 18,
    num_filters: int = 256,
    num_classes: int = 1000,
    image_size: int = 224,
    drop_path: float = 0.0,
    bn_momentum: float | None = None,
    bn_eps: float | None = None,
) -> nn.Sequential:
    """AmoebaNet-D (L, D); see :func:`amoebanet`.

    Example::

        model = amoebanetd(num_layers=3, num_filters=16, num_classes=10)
        assert len(model) == 3 + 6
    """
    return amoebanet(
        "D", num_layers, num_filters, num_classes, image_size, drop_path, bn_momentum, bn_eps
    )


def amoebanetb(
    num_layers: int = 18,
    num_filters: int = 512,
    num_classes: int = 1000,
    image_size: int = 480,
    drop_path: float = 0.0,
    bn_momentum: float | None = None,
    bn_eps: float | None = None,
) -> nn.Sequential:
    """AmoebaNet-B (L, D); the paper's ImageNet model is (18, 512) at 480x480. See
    :func:`amoebanet`.

    Example::

        model = amoebanetb(num_layers=3, num_filters=16, num_classes=10, image_size=64)
        logits = model(torch.randn(2, 3, 64, 64))       # (2, 10)
    """
    return amoebanet(
        "B", num_layers, num_filters, num_classes, image_size, drop_path, bn_momentum, bn_eps
    )
