"""From the config to the pipe, one way: devices, then the spec, then the engine.

:func:`build_pipeline` takes the ``pipeline`` keys to the K workers' devices (this process's, or
each pipeline rank's own), the spec (the config's balance or the planner's, made and checked on
rank 0) and a GPipe or this rank's DistributedPipe, each making real only the layers it holds.
The world is K pipeline ranks x R replicas, K the length of a listed ``pipeline.balance`` / V,
else ``pipeline.num_devices``, else the world size. A bad device list or balance is a
ConfigError naming its ``pipeline.*`` key, before any layer is made real.

Example::

    built = build_pipeline(cfg, model, bundle, loss_fn, World())
    built.pipe.spec.balance, built.feeds, built.plan_choice     # e.g. (2, 2), ("cpu", "cpu"), None
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from giantpipe.config import ConfigError, ExperimentConfig, PipelineConfig
from giantpipe.config.pipeline import as_config_error
from giantpipe.data.bundle import DataBundle, Tensors, batch_size
from giantpipe.engine import GPipe
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.distributed.replicas import mixed_precision_policy
from giantpipe.engine.meta import UnsetError
from giantpipe.engine.pipe import Pipe
from giantpipe.engine.spec import PipelineSpec, virtual_stages_of
from giantpipe.perf.balance import balance_by_params, balance_by_size, balance_by_time
from giantpipe.runner.losses import LossFn
from giantpipe.runner.model import Model
from giantpipe.runner.planning import as_run, plan_pipeline
from giantpipe.runner.world import World


@dataclass(frozen=True)
class Pipeline:
    """What :func:`build_pipeline` gives the run."""

    pipe: Pipe
    feeds: tuple[str, str]
    """Where this process's inputs and targets go (stage 0's device, the last stage's)."""
    plan_choice: dict[str, Any] | None
    """pipeline.plan=auto: the planner's choice and its predictions (summary.json); else None."""


def build_pipeline(
    cfg: ExperimentConfig, model: Model, bundle: DataBundle, loss_fn: LossFn, world: World
) -> Pipeline:
    """Devices, spec, pipe (collective under torchrun): the one way from the config to the
    engine. The spec is made and checked once, on rank 0, and handed to the others; a model
    whose init leaves a parameter unset names ``pipeline.build``."""
    devices, own = worker_devices(cfg.pipeline, world)
    replicas = 1 if world.size == 1 else world.size // len(devices)

    spec, plan_choice = plan_and_spec(cfg, model, bundle, devices, loss_fn, replicas, world, own)
    try:
        if world.size == 1:
            local = GPipe(model.layers, spec=spec, init=model.init)
            return Pipeline(local, (devices[0], devices[spec.num_workers - 1]), plan_choice)
        pipe = DistributedPipe(
            model.layers,
            spec=spec,
            device=torch.device(own),
            init=model.init,
            replica_sharding=as_run(cfg, spec, plan_choice).pipeline.replica_sharding,
            mixed_precision=mixed_precision_policy(cfg.pipeline.precision, own),
        )
    except UnsetError as err:
        raise ConfigError(
            "pipeline.build",
            f"{err}: give the model's Sequential a giantpipe_init_layer "
            "(docs/your-data.md), or build it whole with pipeline.build=host",
        ) from err
    world.bind(pipe)
    return Pipeline(pipe, (own, own), plan_choice)


def worker_devices(cfg: PipelineConfig, world: World) -> tuple[list[str], str]:
    """The K workers' devices, and this process's own (collective under torchrun)."""
    cuda = torch.cuda.device_count()
    if world.size == 1:
        devices = resolve_devices(cfg, cuda)
        return devices, devices[0]
    k, own = world.agree(lambda: (pipeline_ranks(cfg, world.size), rank_device(cfg, cuda)))
    return [str(d) for d in world.gather(own)[:k]], own  # replica 0's ranks are 0..K-1


DEFAULT_CPU_STAND_INS = 2


def resolve_devices(cfg: PipelineConfig, cuda_count: int) -> list[str]:
    """Device names for the stages, before trimming to the number of stages.

    Example::

        resolve_devices(PipelineConfig(devices="cpu", num_devices=3), cuda_count=0)
        # ["cpu", "cpu", "cpu"]
    """
    if isinstance(cfg.devices, list | tuple):
        listed = _check_listed(list(cfg.devices), cuda_count)
        return listed[: cfg.num_devices] if cfg.num_devices else listed
    if cfg.devices == "cuda" or (cfg.devices == "auto" and cuda_count > 0):
        return _cuda_devices(cfg, cuda_count)
    # cpu, or auto without GPUs: stand-in devices that share this machine's cores.
    return ["cpu"] * (_requested_count(cfg) or DEFAULT_CPU_STAND_INS)


def _requested_count(cfg: PipelineConfig) -> int | None:
    """Devices the user asked for: num_devices, else the length of an explicit balance."""
    if cfg.num_devices is not None:
        return cfg.num_devices
    return len(cfg.balance) if isinstance(cfg.balance, list) else None


def _cuda_devices(cfg: PipelineConfig, cuda_count: int) -> list[str]:
    if cuda_count == 0:
        raise ConfigError("pipeline.devices", "cuda requested but no GPU is visible")
    count = cfg.num_devices or cuda_count
    if count > cuda_count:
        raise ConfigError("pipeline.num_devices", f"{count} GPUs requested, {cuda_count} visible")
    return [f"cuda:{i}" for i in range(count)]


def _check_listed(devices: list[str], cuda_count: int) -> list[str]:
    for name in devices:
        kind, _, index = str(name).partition(":")
        if kind not in ("cpu", "cuda") or not (index == "" or index.isdigit()):
            raise ConfigError("pipeline.devices", f"unknown device {name!r} (use cpu or cuda:N)")
        if kind == "cuda":
            if int(index or 0) >= cuda_count:
                raise ConfigError("pipeline.devices", f"{name} not available ({cuda_count} GPUs)")
    return list(devices)


def pipeline_ranks(cfg: PipelineConfig, world: int) -> int:
    """K, the pipeline ranks, for a world of ``world`` processes (the rest are replicas).

    Example::

        pipeline_ranks(PipelineConfig(num_devices=2), world=4)    # 2: two replicas of K=2
    """
    if isinstance(cfg.balance, list | tuple):
        v = virtual_stages_of(cfg.schedule, cfg.virtual_stages)
        k, key = len(cfg.balance) // v, "pipeline.balance"
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


def rank_device(cfg: PipelineConfig, cuda_count: int, local_rank: int | None = None) -> str:
    """This torchrun process's device: entry LOCAL_RANK of a listed ``pipeline.devices`` (the
    list of one machine's devices), cuda:LOCAL_RANK (``cuda``, or ``auto`` with a GPU), else cpu.

    Example::

        rank_device(PipelineConfig(devices=["cuda:1", "cuda:0"]), cuda_count=2, local_rank=0)
        # "cuda:1"
    """
    local = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    if isinstance(cfg.devices, list | tuple):
        listed = _check_listed(list(cfg.devices), cuda_count)
        if local >= len(listed):
            raise ConfigError(
                "pipeline.devices",
                f"local rank {local} has no device: the list names {len(listed)} "
                "(one per process of a machine)",
            )
        return listed[local]
    if cfg.devices == "cuda" or (cfg.devices == "auto" and cuda_count > 0):
        if local >= cuda_count:
            raise ConfigError(
                "pipeline.devices",
                f"local rank {local} needs cuda:{local}; {cuda_count} GPUs visible",
            )
        return f"cuda:{local}"
    return "cpu"


def plan_and_spec(
    cfg: ExperimentConfig,
    model: Model,
    bundle: DataBundle,
    devices: list[str],
    loss_fn: LossFn,
    replicas: int = 1,
    world: World | None = None,
    own: str | None = None,
) -> tuple[PipelineSpec, dict[str, Any] | None]:
    """The pipeline's spec and, under plan=auto, the planner's choice (else None): the
    planner's spec, else the config's with its balance (profiled on the first device by the
    ``time`` and ``memory`` policies), checked against the model and the devices.

    Collective under torchrun (``world``; ``own``: this rank's device): every rank calls it and
    gets the same answer; rank 0 profiles, each rank measures only its own device; a model built
    on meta is made real one layer at a time, never whole."""
    world = world or World()
    sample_inputs, sample_targets = bundle.first_batch(cfg.trainer.seed)
    if cfg.pipeline.plan == "auto":
        return plan_pipeline(
            cfg, model.layers, devices, sample_inputs, sample_targets, loss_fn, replicas,
            world=world, own=own, init=model.init,
        )  # fmt: skip

    def decide() -> tuple[PipelineSpec, dict[str, Any] | None]:
        sample = micro_batch_sample(sample_inputs, cfg.pipeline.chunks)
        balance = resolve_balance(cfg.pipeline, model, devices, sample)
        return pipeline_spec(cfg.pipeline, balance, devices, len(model.layers)), None

    return world.decide(decide)  # on rank 0 (devices[0] is its own); the others receive it


def resolve_balance(
    cfg: PipelineConfig, model: Model, devices: list[str], sample: Tensors
) -> list[int]:
    """A list of layers per stage: the configured list, or the engine's policy over all devices.

    ``sample`` is one micro-batch of inputs (used by the ``time`` and ``memory`` policies, which
    run each layer on ``devices[0]``, one at a time: a model built on meta is made real a layer
    at a time by its init).
    """
    if isinstance(cfg.balance, list):
        return list(cfg.balance)
    layers = model.layers
    stages = len(devices) * virtual_stages_of(cfg.schedule, cfg.virtual_stages)
    if stages > len(layers):
        raise ConfigError(
            "pipeline.num_devices", f"{stages} stages but the model has only {len(layers)} layers"
        )
    if cfg.balance == "params":
        return balance_by_params(stages, layers)  # counts elements: on meta too
    policy = balance_by_time if cfg.balance == "time" else balance_by_size
    return policy(stages, layers, sample, device=devices[0], init=model.init)


def micro_batch_sample(inputs: Tensors, chunks: int) -> Tensors:
    """The first micro-batch of ``inputs``: what the time / memory balance policies profile."""
    size = math.ceil(batch_size(inputs) / chunks)
    return tuple(t[:size] for t in inputs) if isinstance(inputs, tuple) else inputs[:size]


def pipeline_spec(
    cfg: PipelineConfig,
    balance: Sequence[int],
    devices: Sequence[str] | None = None,
    num_layers: int | None = None,
) -> PipelineSpec:
    """The one place a ``pipeline`` config becomes a PipelineSpec: the balance as resolved,
    the first K of ``devices`` (the workers' devices; under torchrun, each pipeline rank's), and
    the config's M, V, schedule, recompute, timeout and deferred BatchNorm; given the model's
    ``num_layers``, checked against it and the devices too. A bad one is a ConfigError naming
    the key; the schedule is built and validated here, once.

    Example::

        spec = pipeline_spec(PipelineConfig(chunks=4, schedule="1f1b"), [2, 2], ["cpu"] * 3)
        spec.devices, spec.step_schedule().name      # ("cpu", "cpu"), "1f1b"
        pipeline_spec(PipelineConfig(), [2, 2], ["cpu"] * 2, num_layers=5)
        # ConfigError: pipeline.balance: [2, 2] sums to 4 but the model has 5 layers
    """
    workers = len(balance) // virtual_stages_of(cfg.schedule, cfg.virtual_stages)
    with as_config_error():
        spec = PipelineSpec(
            balance=tuple(balance),
            chunks=cfg.chunks,
            schedule=cfg.schedule,
            virtual_stages=cfg.virtual_stages,
            recompute=cfg.recompute,
            devices=None if devices is None else tuple(devices[:workers]),
            timeout=cfg.timeout,
            deferred_batch_norm=cfg.deferred_batch_norm,
        )
        if num_layers is not None:
            spec.check_against(num_layers, None if devices is None else len(devices))
    return spec
