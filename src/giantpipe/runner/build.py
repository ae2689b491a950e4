"""Build every part of an experiment from its config, checking it before any training work.

Order matters: cheap checks first (devices, data directory, model length, balance), so a bad
setting fails in seconds with the dotted key, before profiling or allocating the engine.

Example::

    parts = build_experiment(cfg)
    parts.pipe, parts.optimizer, parts.scheduler, parts.bundle
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, PipelineConfig
from giantpipe.data.bundle import DataBundle, Tensors, batch_size
from giantpipe.engine import GPipe
from giantpipe.runner.checkpoint import parameter_names
from giantpipe.runner.ema import WeightEMA
from giantpipe.runner.losses import LossFn, build_loss
from giantpipe.runner.lr_schedule import lr_multiplier
from giantpipe.runner.optim import build_optimizer
from giantpipe.runner.pipeline import (
    build_pipe,
    check_tied_parameters,
    resolve_balance,
    resolve_devices,
)
from giantpipe.runner.planning import plan_pipeline
from giantpipe.runner.registry import build_from_target


@dataclass
class TrainingParts:
    """What both runners build around their engine: the data, where the stages run, and what
    trains the parameters (the local runner's :class:`Experiment`, the distributed runner's
    :class:`~giantpipe.runner.dist_build.DistributedExperiment`)."""

    bundle: DataBundle
    devices: list[str]
    """The device of each worker (pipeline rank), in stage order."""
    balance: list[int]
    names: dict[str, nn.Parameter]
    """Un-partitioned parameter names -> parameters (checkpoints key by these); under the
    distributed runner, this rank's parameters only."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_fn: LossFn
    ema: WeightEMA | None
    steps_per_epoch: float
    """Optimizer steps per epoch (batches per epoch / accumulate)."""
    total_steps: int


@dataclass
class Experiment(TrainingParts):
    """The built parts of a run."""

    model: nn.Sequential
    pipe: GPipe
    pipeline: PipelineConfig
    """The pipeline as run: cfg.pipeline, or with the planner's knobs under plan=auto."""
    plan_choice: dict[str, Any] | None = None
    """pipeline.plan=auto: the planner's choice and its predictions (summary.json)."""


def build_model(cfg: ExperimentConfig) -> nn.Sequential:
    """The model from its ``_target_``; it must be a flat, non-empty nn.Sequential."""
    model = build_from_target(cfg.model, "model")
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise ConfigError("model._target_", "must build a non-empty nn.Sequential")
    return model


def micro_batch_sample(inputs: Tensors, chunks: int) -> Tensors:
    """The first micro-batch of ``inputs``: what the time / memory balance policies profile."""
    size = math.ceil(batch_size(inputs) / chunks)
    return tuple(t[:size] for t in inputs) if isinstance(inputs, tuple) else inputs[:size]


def total_steps(cfg: ExperimentConfig, steps_per_epoch: float) -> int:
    """trainer.max_steps, or trainer.max_epochs converted to optimizer steps."""
    if cfg.trainer.max_steps is not None:
        return cfg.trainer.max_steps
    return max(1, round((cfg.trainer.max_epochs or 0) * steps_per_epoch))


def build_experiment(cfg: ExperimentConfig, run_dir: Path | None = None) -> Experiment:
    """Devices, data, model, balance, engine, optimizer, schedule, loss and EMA.

    ``run_dir`` is handed to data builders that keep files there (a trained vocabulary).
    """
    devices = resolve_devices(cfg.pipeline, torch.cuda.device_count())
    bundle: DataBundle = build_from_target(cfg.data, "data", run_dir=run_dir)
    if not isinstance(bundle, DataBundle):
        raise ConfigError("data._target_", "must build a giantpipe.data.bundle.DataBundle")
    model = build_model(cfg)
    sample_inputs, sample_targets = next(bundle.train_batches(cfg.trainer.seed, 0))
    loss_fn = build_loss(
        bundle.loss,
        cfg.trainer.label_smoothing,
        bundle.ignore_index,
        summed=bundle.loss_normalizer is not None,
    )
    pipeline, plan_choice = cfg.pipeline, None
    if pipeline.plan == "auto":
        pipeline, plan_choice = plan_pipeline(
            cfg, model, devices, sample_inputs, sample_targets, loss_fn
        )
    sample = micro_batch_sample(sample_inputs, pipeline.chunks)
    balance = resolve_balance(pipeline, model, devices, sample)
    check_tied_parameters(model, balance)
    pipe = build_pipe(model, pipeline, balance, devices)
    names = parameter_names(pipe, model)
    optimizer = build_optimizer(names.values(), cfg.optim)
    steps_per_epoch = bundle.batches_per_epoch / cfg.trainer.accumulate
    total = total_steps(cfg, steps_per_epoch)
    factor = lr_multiplier(cfg.optim.lr_schedule, steps_per_epoch, total)
    return Experiment(
        bundle=bundle,
        model=model,
        pipe=pipe,
        devices=devices[: len(balance) // pipeline.virtual_stages],
        balance=balance,
        names=names,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
        loss_fn=loss_fn,
        ema=WeightEMA(names, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        pipeline=pipeline,
        plan_choice=plan_choice,
    )
