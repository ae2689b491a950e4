"""The parts of a distributed run, as each rank builds them: its stage, its optimizer, its data.

Under ``pipeline.executor=distributed`` every torchrun process builds the same things as the
local runner (data bundle, model, balance, optimizer, LR schedule, loss, EMA) but keeps only its
own stage: the engine is a :class:`~giantpipe.engine.dist.pipe.DistributedPipe`, the optimizer
and the EMA cover this rank's parameters, and data reaches only the ranks that hold stage 0
(inputs) or the last stage (targets). With R replicas every batch is split in R along dim 0,
replica r taking slice r, so a step trains on the same samples as the local runner's.

    world size = K pipeline ranks x R replicas
    K: len(pipeline.balance) / V for a listed balance, else pipeline.num_devices, else the
       world size (R = 1)

Example::

    parts = build_distributed(cfg, run_dir)          # every rank, after init_distributed()
    parts.pipe.needs_inputs, parts.pipe.replica, parts.optimizer
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, PipelineConfig
from giantpipe.data.bundle import Batch, DataBundle, Tensors, batch_size
from giantpipe.engine.dist.pipe import DistributedPipe
from giantpipe.engine.stats import StepStats
from giantpipe.runner.build import TrainingParts, micro_batch_sample, total_steps
from giantpipe.runner.checkpoint import first_names
from giantpipe.runner.ema import WeightEMA
from giantpipe.runner.losses import LossFn, build_loss
from giantpipe.runner.lr_schedule import lr_multiplier
from giantpipe.runner.optim import build_optimizer
from giantpipe.runner.pipeline import check_schedule, check_tied_parameters, resolve_balance
from giantpipe.runner.registry import build_from_target
from giantpipe.runner.step import _weighted, autocast, to_device

log = logging.getLogger(__name__)


@dataclass
class DistributedExperiment(TrainingParts):
    """This rank's built parts of a distributed run (``names``: this rank's parameters)."""

    pipe: DistributedPipe
    device: torch.device


def virtual_stages(cfg: PipelineConfig) -> int:
    """V of the config (1 where the schema has no such key)."""
    return int(getattr(cfg, "virtual_stages", 1))


def pipeline_ranks(cfg: PipelineConfig, world: int) -> int:
    """K, the pipeline ranks, for a world of ``world`` processes (the rest are replicas).

    Example::

        pipeline_ranks(PipelineConfig(num_devices=2), world=4)    # 2: two replicas of K=2
    """
    if isinstance(cfg.balance, list | tuple):
        k, key = len(cfg.balance) // virtual_stages(cfg), "pipeline.balance"
    elif cfg.num_devices is not None:
        k, key = cfg.num_devices, "pipeline.num_devices"
    else:
        k, key = world, "pipeline.num_devices"
    if k < 1 or world % k:
        raise ConfigError(
            key,
            f"{k} pipeline ranks do not divide the {world} torchrun processes (world size = "
            "pipeline ranks x replicas; set pipeline.num_devices or --nproc_per_node)",
        )
    return k


def check_supported(cfg: ExperimentConfig) -> None:
    """One line naming the key of each setting the distributed runner does not support."""
    if isinstance(cfg.pipeline.devices, list | tuple):
        raise ConfigError(
            "pipeline.devices",
            "a device list is for the local executor; under distributed each rank uses "
            "cuda:LOCAL_RANK (devices=auto or cuda) or cpu (devices=cpu)",
        )
    if getattr(cfg.pipeline, "plan", None) is not None:
        raise ConfigError("pipeline.plan", "the planner runs with the local executor only")


def rank_device(cfg: PipelineConfig) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK (auto with a GPU, or cuda), else the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.devices == "cuda" or (cfg.devices == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                "pipeline.devices",
                f"local rank {local_rank} needs cuda:{local_rank}; "
                f"{torch.cuda.device_count()} GPUs visible",
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_bundle(cfg: ExperimentConfig, run_dir: Path) -> DataBundle:
    """The data bundle (rank 0 first: builders may write files, e.g. a vocabulary, that the
    other ranks then find in ``run_dir``)."""
    bundle = build_from_target(cfg.data, "data", run_dir=run_dir)
    if not isinstance(bundle, DataBundle):
        raise ConfigError("data._target_", "must build a giantpipe.data.bundle.DataBundle")
    return bundle


def plan_balance(
    cfg: ExperimentConfig, model: nn.Sequential, bundle: DataBundle, k: int, device: torch.device
) -> list[int]:
    """The balance, computed where it is called (rank 0: ``time`` profiles on its device)."""
    sample_inputs, _ = next(bundle.train_batches(cfg.trainer.seed, 0))
    sample = micro_batch_sample(sample_inputs, cfg.pipeline.chunks)
    balance = resolve_balance(cfg.pipeline, model, [str(device)] * k, sample)
    check_tied_parameters(model, balance)
    check_schedule(cfg.pipeline.schedule, k, cfg.pipeline.chunks, *_v_arg(cfg.pipeline))
    return balance


def _v_arg(cfg: PipelineConfig) -> list[int]:
    return [virtual_stages(cfg)] if virtual_stages(cfg) > 1 else []


def build_parts(
    cfg: ExperimentConfig,
    bundle: DataBundle,
    model: nn.Sequential,
    balance: list[int],
    device: torch.device,
) -> DistributedExperiment:
    """The engine over this rank's stage, and everything that trains it (collective).

    ``model`` is built whole on the host as the local runner builds it (so both start from the
    same weights); the pipe keeps this rank's layers and the rest is freed with ``model``.
    """
    pipe = DistributedPipe(
        model,
        balance,
        chunks=cfg.pipeline.chunks,
        checkpoint=cfg.pipeline.recompute,
        schedule=cfg.pipeline.schedule,
        virtual_stages=virtual_stages(cfg.pipeline),
        device=device,
        deferred_batch_norm=cfg.pipeline.deferred_batch_norm,
        init=None,
        timeout=cfg.pipeline.timeout,
    )
    named = {
        k: v for k, v in pipe.state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter)
    }
    names = first_names(named)
    optimizer = build_optimizer(names.values(), cfg.optim)
    steps_per_epoch = bundle.batches_per_epoch / cfg.trainer.accumulate
    total = total_steps(cfg, steps_per_epoch)
    devices: list[Any] = [None] * pipe.layout.workers
    dist.all_gather_object(devices, str(device), group=pipe.groups.pipeline)
    return DistributedExperiment(
        bundle=bundle,
        pipe=pipe,
        device=device,
        devices=[str(d) for d in devices],
        balance=list(balance),
        names=names,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_multiplier(cfg.optim.lr_schedule, steps_per_epoch, total)
        ),
        loss_fn=build_loss(
            bundle.loss,
            cfg.trainer.label_smoothing,
            bundle.ignore_index,
            summed=bundle.loss_normalizer is not None,
        ),
        ema=WeightEMA(names, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
    )


# -- data and engine steps ----------------------------------------------------------------


def replica_slice(tensors: Tensors, replica: int, replicas: int) -> Tensors:
    """Replica ``replica``'s share of a batch: slice ``replica`` of ``replicas`` along dim 0.

    Example::

        replica_slice(torch.arange(10), 1, 2)    # tensor([5, 6, 7, 8, 9])
    """
    if replicas == 1:
        return tensors

    def cut(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor_split(t, replicas)[replica]

    return tuple(cut(t) for t in tensors) if isinstance(tensors, tuple) else cut(tensors)


def engine_steps(
    pipe: DistributedPipe,
    batches: Sequence[Batch | None],
    loss_fn: LossFn,
    normalizer: Callable[[Any], float] | None,
    precision: str,
    device: torch.device,
) -> tuple[float, list[StepStats]]:
    """One ``train_step`` per batch, weighted as :func:`giantpipe.runner.step.
    accumulate_gradients` weights them, so the accumulated gradients are the local runner's.

    Ranks without data pass ``None`` batches. Mean losses: batch ``i`` weighs its whole size
    over the step's (the engine divides by the size summed over replicas); summed losses: the
    engine divides by this replica's share of the step's normalizer, summed over replicas.
    """
    r, replicas = pipe.replica, pipe.replicas
    held = [b for b in batches if b is not None]
    sizes = [batch_size(t) for _, t in held]
    share = (
        sum(normalizer(replica_slice(t, r, replicas)) for _, t in held)
        if normalizer is not None and pipe.needs_targets
        else None
    )
    loss, stats = 0.0, []
    for index, batch in enumerate(batches):
        inputs = targets = None
        step_fn, step_norm = _weighted(loss_fn, 1.0), None
        if batch is not None:
            if pipe.needs_inputs:
                inputs = to_device(replica_slice(batch[0], r, replicas), device)
            if pipe.needs_targets:
                targets = to_device(replica_slice(batch[1], r, replicas), device)
            if normalizer is None:
                step_fn = _weighted(loss_fn, sizes[index] / sum(sizes))
            elif share is not None:
                step_norm = _normalizer_of(share)
        with autocast(precision, str(device)):
            step_loss = pipe.train_step(inputs, targets, step_fn, loss_normalizer=step_norm)
        loss += float(step_loss)
        assert pipe.last_stats is not None
        stats.append(pipe.last_stats)
    return loss, stats


def _normalizer_of(value: float) -> Callable[[Any], float]:
    return lambda _targets: value
