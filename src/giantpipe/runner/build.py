"""Build every part of an experiment from its config, checking it before any training work.

One build for both executors. The local executor is a world of one: its pipe is a
:class:`~giantpipe.engine.GPipe` over K devices of this process. Under torchrun every rank
builds the same things in the same order (data bundle, model, plan, balance, optimizer, LR
schedule, loss, EMA) but keeps only its own stage: a
:class:`~giantpipe.engine.distributed.pipe.DistributedPipe`, with an optimizer and an EMA over its
parameters, and data only where stage 0 (inputs) or the last stage (targets) is. What one rank
decides for all (the plan, a profiled balance) is decided on rank 0 and handed to the others;
a failure on any rank fails every rank at once (:meth:`~giantpipe.runner.world.World.agree`).

Order matters: cheap checks first (devices, data directory, model length, balance), so a bad
setting fails in seconds with the dotted key, before profiling or allocating the engine.

The experiment carries the pipeline's shape as one :class:`~giantpipe.engine.spec.PipelineSpec`
(the config's, or the planner's under ``pipeline.plan=auto``): its balance, M, V, schedule,
recompute and the K workers' devices. What is not shape (precision, executor, plan, memory
budget, split points, output) is read from the experiment config.

Example::

    parts = build_experiment(cfg, run_dir)                    # World(): the local executor
    parts.pipe, parts.spec.chunks, parts.optimizer, parts.scheduler, parts.bundle
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, PipelineConfig
from giantpipe.data.bundle import DataBundle, Tensors, batch_size
from giantpipe.engine.capture import CaptureError, Sequentialized, sequentialize
from giantpipe.engine.distributed.meta import LayerInit
from giantpipe.engine.generate.caches import check_cached
from giantpipe.engine.microbatch import as_tuple
from giantpipe.engine.pipe import Pipe
from giantpipe.engine.spec import PipelineSpec
from giantpipe.runner.ema import WeightEMA
from giantpipe.runner.losses import LossFn, build_loss
from giantpipe.runner.lr_schedule import lr_multiplier
from giantpipe.runner.optim import build_grad_scaler, build_optimizer
from giantpipe.runner.pipeline import (
    build_distributed_pipe,
    build_pipe,
    check_fits,
    pipeline_ranks,
    pipeline_spec,
    rank_device,
    resolve_balance,
    resolve_devices,
)
from giantpipe.runner.planning import as_run, plan_pipeline
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


def build_model(cfg: ExperimentConfig, bundle: DataBundle | None = None) -> nn.Sequential:
    """The model from its ``_target_``: a flat, non-empty nn.Sequential as built, or any other
    module captured as one (:func:`capture_model`, on a sample of ``bundle``'s training data)."""
    model = build_from_target(cfg.model, "model")
    if isinstance(model, nn.Sequential) and not isinstance(model, Sequentialized):
        if len(model) == 0:
            raise ConfigError("model._target_", "must build a non-empty nn.Sequential")
        if cfg.pipeline.split_points is not None:
            raise ConfigError(
                "pipeline.split_points",
                "the model is a flat nn.Sequential already (its children are the pieces); "
                "leave split_points null",
            )
        return model
    if not isinstance(model, nn.Module):
        raise ConfigError("model._target_", "must build an nn.Module")
    if bundle is None:
        with torch.device("cpu"):  # data is made on the host, whatever the default device
            bundle = build_bundle(cfg, None)
    return capture_model(model, cfg, bundle)


def capture_model(model: nn.Module, cfg: ExperimentConfig, bundle: DataBundle) -> nn.Sequential:
    """``model`` (e.g. a Hugging Face or torchvision module) as the flat Sequential the engine
    cuts: :func:`capture` on two samples of the first training batch, at
    ``pipeline.split_points``, ending with ``pipeline.output``.

    Example::

        seq = capture_model(hf_causal_lm("llama", layers=4), cfg, bundle)   # 6 pieces
    """
    inputs, _ = next(bundle.train_batches(cfg.trainer.seed, 0))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    sample = tuple(t[:2].to(device) if isinstance(t, torch.Tensor) else t for t in as_tuple(inputs))
    return capture(model, sample, cfg.pipeline.split_points, cfg.pipeline.output)


def capture(
    model: nn.Module, sample: tuple[Any, ...], split_points: Any, output: str | None
) -> nn.Sequential:
    """:func:`giantpipe.sequentialize` of ``model`` on ``sample`` (its positional inputs), with
    its pieces' key/value caches when the model offers them; it must end with one tensor, the
    output the loss takes. Errors name the config key (``pipeline.split_points``,
    ``pipeline.output``, ``model._target_``). ``recipes/generate.py`` captures a saved run's
    model with it as the runner did.

    Example::

        seq = capture(hf_causal_lm("llama", layers=2), (torch.zeros(2, 8, dtype=torch.long),),
                      None, "logits")                                    # 4 pieces
    """
    try:
        seq = sequentialize(model, *sample, split_points=split_points, output=output)
    except CaptureError as err:
        key = {"split_points": "pipeline.split_points", "output": "pipeline.output"}
        raise ConfigError(key.get(err.about, "model._target_"), str(err)) from err
    if seq.out_spec.num_leaves != 1:
        raise ConfigError(
            "pipeline.output",
            f"the model returns {seq.out_spec.num_leaves} values ({seq.out_spec.type}); name "
            "the one the loss takes, e.g. pipeline.output=logits",
        )
    # A model may give its pieces key/value caches for generation (models.hf's builder offers
    # it): called with the model while it is still whole, it keeps only each piece's own parts.
    cache_pieces = getattr(model, "giantpipe_cache_pieces", None)
    if callable(cache_pieces):
        cache_pieces(model, list(seq), seq.spans)
    return seq


def build_bundle(cfg: ExperimentConfig, run_dir: Path | None) -> DataBundle:
    """The data bundle (``run_dir`` is where builders keep files, e.g. a trained vocabulary;
    ``progress``, logger.progress, whether their own progress bars show)."""
    bundle = build_from_target(cfg.data, "data", run_dir=run_dir, progress=cfg.logger.progress)
    if not isinstance(bundle, DataBundle):
        raise ConfigError("data._target_", "must build a giantpipe.data.bundle.DataBundle")
    return bundle


def micro_batch_sample(inputs: Tensors, chunks: int) -> Tensors:
    """The first micro-batch of ``inputs``: what the time / memory balance policies profile."""
    size = math.ceil(batch_size(inputs) / chunks)
    return tuple(t[:size] for t in inputs) if isinstance(inputs, tuple) else inputs[:size]


def total_steps(cfg: ExperimentConfig, steps_per_epoch: float) -> int:
    """trainer.max_steps, or trainer.max_epochs converted to optimizer steps."""
    if cfg.trainer.max_steps is not None:
        return cfg.trainer.max_steps
    return max(1, round((cfg.trainer.max_epochs or 0) * steps_per_epoch))


def worker_devices(cfg: PipelineConfig, world: World) -> tuple[list[str], str]:
    """The K workers' devices, and this process's own (collective under torchrun)."""
    cuda = torch.cuda.device_count()
    if world.size == 1:
        devices = resolve_devices(cfg, cuda)
        return devices, devices[0]
    k, own = world.agree(lambda: (pipeline_ranks(cfg, world.size), rank_device(cfg, cuda)))
    return [str(d) for d in world.gather(own)[:k]], own  # replica 0's ranks are 0..K-1


def loss_of(cfg: ExperimentConfig, bundle: DataBundle) -> LossFn:
    """The training loss the data asks for (label smoothing from trainer.label_smoothing)."""
    return build_loss(
        bundle.loss,
        cfg.trainer.label_smoothing,
        bundle.ignore_index,
        summed=bundle.loss_normalizer is not None,
    )


def plan_and_spec(
    cfg: ExperimentConfig,
    model: nn.Sequential,
    bundle: DataBundle,
    devices: list[str],
    replicas: int = 1,
    world: World | None = None,
    own: str | None = None,
    init: LayerInit | None = None,
) -> tuple[PipelineSpec, dict[str, Any] | None]:
    """The pipeline's spec and, under plan=auto, the planner's choice (else None): the
    planner's spec, else the config's with its balance (profiled on the first device by the
    ``time`` and ``memory`` policies), checked against the model and the devices. The spec, and
    so the schedule, is made and checked once, here.

    Collective under torchrun (``world``; ``own``: this rank's device): every rank calls it and
    gets the same answer; rank 0 profiles, each rank measures only its own device. ``model`` may
    be built on meta, each layer then made real by ``init`` one at a time."""
    world = world or World()
    sample_inputs, sample_targets = next(bundle.train_batches(cfg.trainer.seed, 0))
    if cfg.pipeline.plan == "auto":
        loss_fn = loss_of(cfg, bundle)
        return plan_pipeline(
            cfg, model, devices, sample_inputs, sample_targets, loss_fn, replicas,
            world=world, own=own, init=init,
        )  # fmt: skip

    def decide() -> tuple[PipelineSpec, dict[str, Any] | None]:
        sample = micro_batch_sample(sample_inputs, cfg.pipeline.chunks)
        balance = resolve_balance(cfg.pipeline, model, devices, sample, init)
        spec = pipeline_spec(cfg.pipeline, balance, devices)
        check_fits(spec, len(model), len(devices))
        return spec, None

    # decided once, on rank 0 (devices[0] is its own); the others receive the spec as made
    return world.decide(decide)


def build_experiment(
    cfg: ExperimentConfig, run_dir: Path | None = None, world: World | None = None
) -> Experiment:
    """Devices, data, model, plan, balance, engine, optimizer, LR schedule, loss and EMA.

    Under torchrun (``world``) rank 0 builds the data first (builders may write files, e.g. a
    vocabulary, that the other ranks then find in ``run_dir``) and plans and balances for all.
    """
    world = world or World()
    devices, own = worker_devices(cfg.pipeline, world)
    first = world.agree(lambda: build_bundle(cfg, run_dir) if world.rank == 0 else None)

    def model_and_bundle() -> tuple[DataBundle, nn.Sequential]:
        bundle = first or build_bundle(cfg, run_dir)
        return bundle, build_model(cfg, bundle)

    bundle, model = world.agree(model_and_bundle)
    replicas = world.size // len(devices) if world.size % len(devices) == 0 else 1
    spec, plan_choice = plan_and_spec(cfg, model, bundle, devices, replicas, world, own)
    workers = spec.num_workers
    check_generates(cfg, bundle, model)
    pipe: Pipe
    if world.size == 1:
        pipe = build_pipe(model, spec)
        inputs_to, targets_to = devices[0], devices[workers - 1]
    else:
        as_planned = as_run(cfg, spec, plan_choice).pipeline  # the planned replica_sharding
        pipe = build_distributed_pipe(model, spec, own, as_planned)
        world.bind(pipe)
        inputs_to = targets_to = own
    # No rank keeps the whole model under torchrun: whole-model evaluation runs through the pipe.
    return _training_parts(
        cfg, bundle, model if world.size == 1 else None, pipe, (inputs_to, targets_to), plan_choice
    )


def check_generates(cfg: ExperimentConfig, bundle: DataBundle, model: nn.Sequential) -> None:
    """An evaluation that decodes through the pipe (``generates``: held-out BLEU, LM samples)
    needs a model whose children can keep key/value caches: refused up front, naming the key
    that asked."""
    hook = bundle.evaluate_model
    if not getattr(hook, "generates", False):
        return
    try:
        check_cached(list(model))
    except TypeError as err:
        arch = getattr(cfg.model, "architecture", None)
        named = f"model {arch!r}: " if arch else ""
        raise ConfigError(getattr(hook, "config_key", "model._target_"), named + str(err)) from err


def _training_parts(
    cfg: ExperimentConfig,
    bundle: DataBundle,
    model: nn.Sequential | None,
    pipe: Pipe,
    feeds: tuple[str, str],
    plan_choice: dict[str, Any] | None,
) -> Experiment:
    """What trains the pipe's parameters: optimizer, LR schedule, loss and EMA."""
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
        loss_fn=loss_of(cfg, bundle),
        ema=WeightEMA(names, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        plan_choice=plan_choice,
        grad_scaler=build_grad_scaler(pipe, cfg.pipeline.precision),
    )
