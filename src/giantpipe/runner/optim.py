"""The optimizer and the fp16 gradient scaler it steps through.

Optimizers from ``OptimConfig``: sgd (momentum, Nesterov), adam, adamw, rmsprop.
``pipeline.precision=fp16`` steps the optimizer through a gradient scaler, one verdict on
inf/NaN for every rank (:meth:`giantpipe.engine.pipe.Pipe.grad_scaler`). The learning-rate
schedule is :mod:`giantpipe.runner.lr_schedule`, the weights' average :mod:`giantpipe.runner.ema`.

Example::

    optimizer = build_optimizer(pipe.parameters(), OptimConfig(name="sgd", lr=0.1, momentum=0.9))
    scaler = build_grad_scaler(pipe, "fp16")      # None for fp32 and bf16
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from giantpipe.config import OptimConfig
from giantpipe.engine.pipe import Pipe


def build_optimizer(params: Iterable[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The configured optimizer over ``params`` at the peak learning rate ``cfg.lr``.

    rmsprop maps TF's names: ``alpha`` is TF's ``decay``; TF-style is alpha 0.9, momentum 0.9,
    eps 1.0 (see conf/optim/rmsprop_tf.yaml).
    """
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    if cfg.name in ("adam", "adamw"):
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        betas = (float(cfg.betas[0]), float(cfg.betas[1]))
        return cls(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(
            params,
            lr=cfg.lr,
            alpha=cfg.alpha,
            eps=cfg.eps,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )
    raise ValueError(f"unknown optimizer {cfg.name!r}")  # unreachable: OptimConfig checks names


def build_grad_scaler(pipe: Pipe, precision: str) -> torch.amp.GradScaler | None:
    """fp16's gradient scaler for ``pipe`` (torch's defaults: scale 2**16, doubled after 2000
    steps without overflow, halved on one); None for fp32 and bf16, whose range needs none.

    Example::

        scaler = build_grad_scaler(pipe, "fp16")
        loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
        scaler.step(optimizer); scaler.update()
    """
    return pipe.grad_scaler() if precision == "fp16" else None
