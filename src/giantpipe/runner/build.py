"""Build every part of an experiment from its config, checking it before any training work.

One build for both executors: the data bundle, the model (on meta, :mod:`.model`), the pipe
(devices, spec and engine, :mod:`.pipeline`), then what trains it (optimizer, LR schedule, loss,
EMA). Under torchrun every rank builds the same things in the same order but makes real only
its own stages (its shards, with replicas), and holds data only where its stages need it; what
one rank decides for all (the plan, a profiled balance) rank 0 decides, and a failure on any
rank fails every rank (:meth:`~giantpipe.runner.world.World.agree`).

Example::

    parts = build_experiment(cfg, run_dir)                    # World(): the local executor
    parts.pipe, parts.spec.chunks, parts.optimizer, parts.scheduler, parts.bundle
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.data.bundle import DataBundle
from giantpipe.engine.pipe import Pipe
from giantpipe.engine.spec import PipelineSpec
from giantpipe.runner.ema import WeightEMA
from giantpipe.runner.losses import LossFn, build_loss
from giantpipe.runner.lr_schedule import lr_multiplier
from giantpipe.runner.model import Model, build_model
from giantpipe.runner.optim import build_grad_scaler, build_optimizer
from giantpipe.runner.pipeline import Pipeline, build_pipeline, worker_devices
from giantpipe.runner.preflight import check_fit
from giantpipe.runner.registry import build_from_target
from giantpipe.runner.world import World


@dataclass
class Experiment:
    """The built parts of a run, as this process holds them (under torchrun: this rank's)."""

    bundle: DataBundle
    model: nn.Sequential | None
    """The whole plain model in one process (the local executor's: its layers are the pipe's);
    None under torchrun, where no rank holds it (whole-model evaluation runs through the pipe,
    :func:`~giantpipe.runner.evaluate.whole_model_figures`)."""
    pipe: Pipe
    spec: PipelineSpec
    """The pipeline's shape as run (``pipe.spec``): the config's, or the planner's under
    plan=auto; its ``devices`` are the K workers' (pipeline ranks'), in stage order."""
    input_device: str
    """Where this process's inputs go (stage 0's device)."""
    target_device: str
    """Where this process's targets go (the last stage's device)."""
    names: dict[str, nn.Parameter]
    """Un-partitioned parameter names -> this process's parameters (checkpoints key by these)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_fn: LossFn
    ema: WeightEMA | None
    steps_per_epoch: float
    """Optimizer steps per epoch (batches per epoch / accumulate)."""
    total_steps: int
    plan_choice: dict[str, Any] | None = None
    """pipeline.plan=auto: the planner's choice and its predictions (summary.json)."""
    grad_scaler: torch.amp.GradScaler | None = None
    """pipeline.precision=fp16: the loss scaler the optimizer steps through (else None)."""


def first_names(named: Mapping[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    """One name per parameter: a shared one (e.g. one embedding table for source and target)
    appears once, under its first name, so the optimizer does not update it twice per step.

    Example::

        first_names({"0.src.weight": w, "0.tgt.weight": w})   # {"0.src.weight": w}
    """
    seen: set[int] = set()
    unique: dict[str, nn.Parameter] = {}
    for name, param in named.items():
        if id(param) not in seen:
            seen.add(id(param))
            unique[name] = param
    return unique


def parameter_names(pipe: nn.Module, model: nn.Module | None = None) -> dict[str, nn.Parameter]:
    """Un-partitioned name -> parameter, for every parameter the engine trains (on this rank).

    The engine's ``state_dict(keep_vars=True)`` gives the names; the plain model's
    ``named_parameters()`` is the fallback (the engine moves layers in place, keeping the objects).
    """
    live = {id(p) for p in pipe.parameters()}
    candidates = [
        {k: v for k, v in pipe.state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter)}
    ]
    if model is not None:
        candidates.append(dict(model.named_parameters()))
    for named in candidates:
        if {id(p) for p in named.values()} == live:
            return first_names(named)
    raise RuntimeError("cannot name the engine's parameters; checkpoints need un-partitioned names")


def build_bundle(cfg: ExperimentConfig, run_dir: Path | None) -> DataBundle:
    """The data bundle (``run_dir`` is where builders keep files, e.g. a trained vocabulary;
    ``progress``, logger.progress, whether their own progress bars show)."""
    bundle = build_from_target(cfg.data, "data", run_dir=run_dir, progress=cfg.logger.progress)
    if not isinstance(bundle, DataBundle):
        raise ConfigError("data._target_", "must build a giantpipe.data.bundle.DataBundle")
    return bundle


def total_steps(cfg: ExperimentConfig, steps_per_epoch: float) -> int:
    """trainer.max_steps, or trainer.max_epochs converted to optimizer steps."""
    if cfg.trainer.max_steps is not None:
        return cfg.trainer.max_steps
    return max(1, round((cfg.trainer.max_epochs or 0) * steps_per_epoch))


def loss_of(cfg: ExperimentConfig, bundle: DataBundle) -> LossFn:
    """The training loss the data asks for (label smoothing from trainer.label_smoothing)."""
    return build_loss(
        bundle.loss,
        cfg.trainer.label_smoothing,
        bundle.ignore_index,
        summed=bundle.loss_normalizer is not None,
    )


def build_experiment(
    cfg: ExperimentConfig, run_dir: Path | None = None, world: World | None = None
) -> Experiment:
    """Data, model, pipe (devices, spec, engine), optimizer, LR schedule, loss and EMA.

    Under torchrun (``world``) rank 0 builds the data first (builders may write files, e.g. a
    vocabulary, that the other ranks then find in ``run_dir``) and plans and balances for all.
    """
    world = world or World()
    first = world.agree(lambda: build_bundle(cfg, run_dir) if world.rank == 0 else None)

    def data_and_model() -> tuple[DataBundle, Model]:
        bundle = first or build_bundle(cfg, run_dir)
        # Before anything is allocated each rank sizes the run against its own device: the
        # model as built on meta, or (pipeline.build=host) built again under the meta device
        # before its whole copy is allocated.
        devices, _ = worker_devices(cfg.pipeline, world)
        if cfg.pipeline.build == "host":
            check_fit(cfg, bundle, devices, world, lambda: build_model(cfg, bundle).layers)
            return bundle, build_model(cfg, bundle)
        model = build_model(cfg, bundle)  # parameters on meta: nothing allocated
        # sized on a copy whose buffers (BatchNorm's statistics, real) are on meta too
        check_fit(cfg, bundle, devices, world, lambda: copy.deepcopy(model.layers).to("meta"))
        return bundle, model

    bundle, model = world.agree(data_and_model)
    loss_fn = loss_of(cfg, bundle)
    pipeline = build_pipeline(cfg, model, bundle, loss_fn, world)
    return _training_parts(
        cfg, bundle, model.layers if world.size == 1 else None, pipeline, loss_fn
    )


def _training_parts(
    cfg: ExperimentConfig,
    bundle: DataBundle,
    model: nn.Sequential | None,
    pipeline: Pipeline,
    loss_fn: LossFn,
) -> Experiment:
    """What trains the pipe's parameters: optimizer, LR schedule and EMA."""
    pipe, feeds = pipeline.pipe, pipeline.feeds
    names = parameter_names(pipe, model)
    optimizer = build_optimizer(names.values(), cfg.optim)
    steps_per_epoch = bundle.batches_per_epoch / cfg.trainer.accumulate
    total = total_steps(cfg, steps_per_epoch)
    factor = lr_multiplier(cfg.optim.lr_schedule, steps_per_epoch, total)
    return Experiment(
        bundle=bundle,
        model=model,
        pipe=pipe,
        spec=pipe.spec,
        input_device=feeds[0],
        target_device=feeds[1],
        names=names,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
        loss_fn=loss_fn,
        ema=WeightEMA(names, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        plan_choice=pipeline.plan_choice,
        grad_scaler=build_grad_scaler(pipe, cfg.pipeline.precision),
    )
