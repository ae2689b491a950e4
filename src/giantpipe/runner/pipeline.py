"""From ``PipelineConfig`` to an engine: devices, balance, the pipeline's spec and the pipe.

The local executor's pipe is a :class:`~giantpipe.engine.GPipe` over K devices of this process;
under torchrun each rank builds a
:class:`~giantpipe.engine.distributed.pipe.DistributedPipe` over its own device, and
the world is K pipeline ranks x R replicas::

    K: len(pipeline.balance) / V for a listed balance, else pipeline.num_devices, else the
       world size (R = 1)

Everything here is checked before any training work: a bad device list, a balance that does not
fit the model or more stages than devices is a ConfigError naming the ``pipeline.*`` key. The
config becomes a :class:`~giantpipe.engine.spec.PipelineSpec` in one place,
:func:`pipeline_spec` (the spec checks M, V, the schedule, built once there, and the timeout),
and the spec is checked against the model and the devices once, :func:`check_fits`.

Example::

    devices = resolve_devices(cfg.pipeline, torch.cuda.device_count())    # ["cpu", "cpu"]
    balance = resolve_balance(cfg.pipeline, model, devices, sample)       # e.g. [4, 4]
    spec = pipeline_spec(cfg.pipeline, balance, devices)
    check_fits(spec, len(model), len(devices))
    pipe = build_pipe(model, spec)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from giantpipe.config import ConfigError, PipelineConfig
from giantpipe.config.pipeline import as_config_error
from giantpipe.data.bundle import Tensors
from giantpipe.engine import GPipe
from giantpipe.engine.distributed.meta import LayerInit
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.distributed.replicas import MixedPrecisionPolicy, mixed_precision_policy
from giantpipe.engine.spec import PipelineSpec, virtual_stages_of
from giantpipe.perf.balance import balance_by_params, balance_by_size, balance_by_time

DEFAULT_CPU_STAND_INS = 2


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


def pipeline_ranks(cfg: PipelineConfig, world: int) -> int:
    """K, the pipeline ranks, for a world of ``world`` processes (the rest are replicas).

    Example::

        pipeline_ranks(PipelineConfig(num_devices=2), world=4)    # 2: two replicas of K=2
    """
    if isinstance(cfg.balance, list | tuple):
        k, key = len(cfg.balance) // stages_per_worker(cfg), "pipeline.balance"
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


def stages_per_worker(cfg: PipelineConfig) -> int:
    """V: ``pipeline.virtual_stages``, else the schedule's (the spec's rule).

    Example::

        stages_per_worker(PipelineConfig(schedule="interleaved"))     # 2
    """
    return virtual_stages_of(cfg.schedule, cfg.virtual_stages)


def check_fits(spec: PipelineSpec, num_layers: int, num_devices: int) -> None:
    """The spec against the model (its ``num_layers`` layers) and the ``num_devices`` devices
    there are: :meth:`PipelineSpec.check_against`, as the ConfigError of ``pipeline.balance``.

    Example::

        check_fits(PipelineSpec((2, 2)), 5, 2)
        # ConfigError: pipeline.balance: [2, 2] sums to 4 but the model has 5 layers
    """
    with as_config_error():
        spec.check_against(num_layers, num_devices)


def resolve_balance(
    cfg: PipelineConfig,
    model: nn.Sequential,
    devices: list[str],
    sample: Tensors,
    init: LayerInit | None = None,
) -> list[int]:
    """A list of layers per stage: the configured list, or the engine's policy over all devices.

    ``sample`` is one micro-batch of inputs (used by the ``time`` and ``memory`` policies, which
    run each layer on ``devices[0]``, one at a time: a model built on meta takes ``init``).
    """
    if isinstance(cfg.balance, list):
        balance = list(cfg.balance)
    else:
        stages = len(devices) * stages_per_worker(cfg)
        if stages > len(model):
            raise ConfigError(
                "pipeline.num_devices",
                f"{stages} stages but the model has only {len(model)} layers",
            )
        if cfg.balance == "params":
            balance = balance_by_params(stages, model)
        elif cfg.balance == "time":
            balance = balance_by_time(stages, model, sample, device=devices[0], init=init)
        else:
            balance = balance_by_size(stages, model, sample, device=devices[0], init=init)
    return balance


def pipeline_spec(
    cfg: PipelineConfig, balance: Sequence[int], devices: Sequence[str] | None = None
) -> PipelineSpec:
    """The one place a ``pipeline`` config becomes a PipelineSpec: the balance as resolved,
    the first K of ``devices`` (the workers' devices; under torchrun, each pipeline rank's), and
    the config's M, V, schedule, recompute, timeout and deferred BatchNorm. A bad one is a
    ConfigError naming the key; the schedule is built and validated here, once. Whether it fits
    the model is :func:`check_fits`.

    Example::

        spec = pipeline_spec(PipelineConfig(chunks=4, schedule="1f1b"), [2, 2], ["cpu"] * 3)
        spec.devices, spec.step_schedule().name      # ("cpu", "cpu"), "1f1b"
    """
    workers = len(balance) // stages_per_worker(cfg)
    with as_config_error():
        return PipelineSpec(
            balance=tuple(balance),
            chunks=cfg.chunks,
            schedule=cfg.schedule,
            virtual_stages=cfg.virtual_stages,
            recompute=cfg.recompute,
            devices=None if devices is None else tuple(devices[:workers]),
            timeout=cfg.timeout,
            deferred_batch_norm=cfg.deferred_batch_norm,
        )


def build_pipe(model: nn.Sequential, spec: PipelineSpec) -> GPipe:
    """The local engine over the spec's devices, with its M, schedule and modes."""
    return GPipe(model, spec=spec)


def build_distributed_pipe(
    model: nn.Sequential, spec: PipelineSpec, device: str, cfg: PipelineConfig | None = None
) -> DistributedPipe:
    """This rank's engine (collective): it keeps its own stage of ``model``, built whole on the
    host as the local runner builds it, so that both start from the same weights. With R > 1
    replicas its stages are spread over them as ``cfg.replica_sharding`` says, with FSDP2's
    mixed precision for ``cfg.precision`` on this device (:func:`replica_precision`)."""
    cfg = cfg or PipelineConfig()
    return DistributedPipe(
        model,
        spec=spec,
        device=torch.device(device),
        init=None,
        replica_sharding=cfg.replica_sharding,
        mixed_precision=replica_precision(cfg, device),
    )


def replica_precision(cfg: PipelineConfig, device: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision for the replicas of a stage on ``device``: on a GPU, bf16 and
    fp16 gather the parameters in that type and reduce the gradients in float32; torch's
    default (each tensor's own type) on the CPU and in fp32.

    Example::

        replica_precision(PipelineConfig(precision="bf16"), "cuda:0").param_dtype  # bfloat16
        replica_precision(PipelineConfig(precision="bf16"), "cpu").param_dtype     # None
    """
    return mixed_precision_policy(cfg.precision, device)
