"""A small MLP classifier as a flat ``nn.Sequential``: the runner's quick-start and test model.

Each child is one unit of partitioning: ``depth`` hidden blocks (Linear, norm, ReLU, dropout)
and a linear head, so the Sequential has ``depth + 1`` children to balance across stages.
``models.options.MlpModelConfig`` is the schema of its option (``conf/model/mlp.yaml``).

Example::

    from models.mlp import mlp

    model = mlp(in_features=32, hidden=64, depth=3, classes=8)
    len(model)                              # 4
    model(torch.randn(16, 32)).shape        # (16, 8)
"""

from __future__ import annotations

from torch import nn


def block(in_features: int, out_features: int, norm: str, dropout: float) -> nn.Sequential:
    """Linear -> norm (``layer``, ``batch`` or ``none``) -> ReLU -> optional dropout."""
    layers: list[nn.Module] = [nn.Linear(in_features, out_features)]
    if norm == "layer":
        layers.append(nn.LayerNorm(out_features))
    elif norm == "batch":
        layers.append(nn.BatchNorm1d(out_features))
    elif norm != "none":
        raise ValueError(f"norm must be layer, batch or none, got {norm!r}")
    layers.append(nn.ReLU())
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def mlp(
    in_features: int = 16,
    hidden: int = 64,
    depth: int = 4,
    classes: int = 8,
    dropout: float = 0.0,
    norm: str = "layer",
) -> nn.Sequential:
    """``depth`` hidden blocks of width ``hidden`` and a linear head to ``classes`` logits."""
    widths = [in_features] + [hidden] * depth
    blocks = [block(a, b, norm, dropout) for a, b in zip(widths[:-1], widths[1:], strict=True)]
    return nn.Sequential(*blocks, nn.Linear(widths[-1], classes))
