"""``pipeline.plan=auto``: the planner (:mod:`giantpipe.perf.planner`) on the run's own model.

It plans on the run's own devices, no rank holding the whole model or touching another rank's
device: bytes per layer come from the meta device, seconds per layer from rank 0's own device
one layer at a time, the ranks' memory and links are agreed (the least, the slowest), and with
R > 1 replicas the least sharded ``replica_sharding`` that fits is taken. What goes in, and how
it is measured: docs/timing-and-planner.md#planning-without-the-whole-model.

Example::

    spec, choice = plan_pipeline(cfg, model, ["cpu", "cpu"], inputs, targets, loss_fn)
    spec.balance, spec.chunks, spec.recompute, spec.schedule     # what GPipe(spec=spec) runs
    as_run(cfg, spec, choice)              # the config as run (the record's config)
    choice["predicted_samples_per_s"], choice["replica_sharding"]
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, OptimConfig, PipelineConfig
from giantpipe.data.bundle import Tensors, batch_size
from giantpipe.engine.meta import LayerInit
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.spec import PipelineSpec
from giantpipe.perf.costs import (
    LayerCost,
    LayerTimer,
    measure_layers,
    meta_copy,
    meta_sample,
    per_sample,
)
from giantpipe.perf.links import local_bandwidth, neighbour_bandwidth
from giantpipe.perf.planner import (
    Candidate,
    DeviceSpec,
    Ranked,
    format_table,
    plan,
    progress_bar,
)
from giantpipe.perf.predict import executor_overhead
from giantpipe.perf.replica_state import ReplicaSharding
from giantpipe.perf.sharding_choice import ShardingChoice, choose_sharding
from giantpipe.runner.losses import LossFn
from giantpipe.runner.step import autocast
from giantpipe.runner.world import World

log = logging.getLogger(__name__)

GIB = 2**30
TOP = 5
"""Rows of the candidates table in the log."""


@dataclass(frozen=True)
class Hardware:
    """What the ranks agree on before planning: every device must fit the plan, and the
    slowest link paces the boundaries."""

    memory_bytes: float
    """The smallest of the ranks' budgets (bytes per device)."""
    link_bandwidth: float
    """The slowest link between neighbouring pipeline devices (bytes/s; inf: none crosses)."""


def plan_pipeline(
    cfg: ExperimentConfig,
    model: nn.Sequential,
    devices: list[str],
    inputs: Tensors,
    targets: Tensors,
    loss_fn: LossFn,
    replicas: int = 1,
    *,
    world: World | None = None,
    own: str | None = None,
    init: LayerInit | None = None,
) -> tuple[PipelineSpec, dict[str, Any]]:
    """The planner's spec (its balance, chunks, recompute, schedule and V; the config's
    timeout and deferred BatchNorm; ``devices``), and the choice as a dict for summary.json
    (with ``replica_sharding``, the mode the replicas take, and why).
    ``inputs`` and ``targets`` are one training batch; under torchrun each of the
    ``replicas`` pipelines takes its share of it.

    Collective under torchrun (``world``): every rank calls it, ``own`` its device (default:
    the first of ``devices``); each measures only that device and its link
    (:func:`agree_hardware`), rank 0 measures the layers one at a time on its own device, plans,
    and every rank gets its answer. ``model`` may be built on meta (parameters on the meta
    device), each layer then made real by ``init``. Leaves the model's parameters, gradients,
    buffers and the RNG streams as they were.
    """
    world = world or World()
    own = own or devices[0]
    hardware = agree_hardware(cfg.pipeline, devices, own, world)
    args = (cfg, model, devices, own, inputs, targets, loss_fn, replicas, hardware, init)
    return world.decide(lambda: _plan(*args, local=world.size == 1))


def agree_hardware(cfg: PipelineConfig, devices: list[str], own: str, world: World) -> Hardware:
    """The memory budget and link bandwidth the plan is made for (collective under torchrun).

    One process (the local executor) measures its own devices. Under torchrun each rank
    measures only ``own``: its memory, and its link to the next pipeline rank
    (:func:`~giantpipe.perf.links.neighbour_bandwidth`); the ranks take the least memory and
    the slowest link.
    """
    if world.size == 1:
        return Hardware(memory_budget(cfg, devices), local_bandwidth(devices))
    k = len(devices)
    memory = world.agree(lambda: memory_budget(cfg, [own], sharing=k))
    link = world.agree(lambda: neighbour_bandwidth(world.rank, k, own))
    every = world.gather((memory, link))
    links = [b for _, b in every if b is not None]
    return Hardware(min(m for m, _ in every), min(links, default=math.inf))


def _plan(
    cfg: ExperimentConfig,
    model: nn.Sequential,
    devices: list[str],
    own: str,
    inputs: Tensors,
    targets: Tensors,
    loss_fn: LossFn,
    replicas: int,
    hardware: Hardware,
    init: LayerInit | None,
    local: bool,
) -> tuple[PipelineSpec, dict[str, Any]]:
    """Rank 0's part: measure (on ``own`` only, unless ``local``: this process's devices),
    search, and choose."""
    started = time.perf_counter()
    size, k = max(1, batch_size(inputs) // replicas), len(devices)
    min_micro = 2 if has_batchnorm(model) else 1
    chunks = chunk_options(size, min_micro)
    touched = devices if local else [own] * k  # a local executor's devices are all its own
    micro = sorted({size // max(chunks), size // min(chunks)})  # a replica's micro-batches
    layers, timer, overhead = _measure(cfg, model, touched, inputs, targets, loss_fn, micro, init)
    spec = DeviceSpec(
        peak_flops=1.0,  # unused: layer times are measured
        memory_bytes=hardware.memory_bytes,
        link_bandwidth=hardware.link_bandwidth,
        link_latency=0.0,
    )
    search = functools.partial(
        _search,
        layers,
        k,
        size,
        spec,
        chunks=chunks,
        optimizer_slots=optimizer_slots(cfg.optim),
        layer_times=timer,
        overhead=overhead,
    )
    if replicas > 1:
        sharding = choose_sharding(search, replicas)
    else:
        one = ReplicaSharding(1, cfg.pipeline.replica_sharding)
        sharding = ShardingChoice(one.mode, 1, search(one))
    candidates = sharding.candidates
    if not candidates:
        raise _nothing_fits(candidates, spec, size, k)
    best = candidates[0]
    why = sharding.why(spec.memory_bytes, spec.reserve)
    log.info(
        "pipeline.plan=auto (%.1fs): %d configurations fit %.3g GiB per device (batch %d, K=%d, "
        "R=%d, M in %s; replica_sharding=%s: %s); the best %d, by simulation on measured layer "
        "times:\n%s",
        *(time.perf_counter() - started, candidates.fitting, spec.memory_bytes / GIB, size, k),
        *(replicas, chunks, sharding.mode, why, len(candidates)),
        format_table(candidates[:TOP]),
    )
    chosen = best.spec(
        devices=tuple(devices),
        timeout=cfg.pipeline.timeout,
        deferred_batch_norm=cfg.pipeline.deferred_batch_norm,
    )
    return chosen, describe(best, hardware, candidates.fitting, sharding, why)


def _search(
    layers: list[LayerCost],
    k: int,
    size: int,
    spec: DeviceSpec,
    sharding: ReplicaSharding,
    **options: Any,
) -> Ranked:
    with progress_bar() as progress:
        return plan(layers, k, size, spec, top=TOP, progress=progress, replicas=sharding, **options)


def as_run(
    cfg: ExperimentConfig, spec: PipelineSpec, choice: dict[str, Any] | None = None
) -> ExperimentConfig:
    """The experiment config as run, what the run's record logs: under plan=auto the planner's
    knobs (``spec``'s balance, M, recompute, schedule and V, and the ``choice``'s
    replica_sharding) in place of the config's; else ``cfg`` itself.

    Example::

        as_run(cfg, PipelineSpec((2, 2), chunks=8)).pipeline.chunks   # 8 if cfg plans, else cfg's
    """
    if cfg.pipeline.plan != "auto":
        return cfg
    pipeline = replace(
        cfg.pipeline,
        balance=list(spec.balance),
        chunks=spec.chunks,
        recompute=spec.recompute,
        schedule=spec.schedule,
        virtual_stages=spec.virtual_stages,
        replica_sharding=(choice or {}).get("replica_sharding") or cfg.pipeline.replica_sharding,
    )
    return replace(cfg, pipeline=pipeline)


def _measure(
    cfg: ExperimentConfig,
    model: nn.Sequential,
    devices: list[str],
    inputs: Tensors,
    targets: Tensors,
    loss_fn: LossFn,
    micro: list[int],
    init: LayerInit | None,
) -> tuple[list[LayerCost], LayerTimer, float]:
    """Bytes per layer and sample, seconds per layer (at the ``micro``-batch sizes, the search's
    smallest and largest, on ``devices[0]``) and the executor's cost per action (its K stages
    on ``devices``), the RNG streams left as they were. Only ``devices`` are touched."""
    min_micro = 2 if has_batchnorm(model) else 1
    cuda = sorted({torch.device(d) for d in devices if torch.device(d).type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=cuda), autocast(cfg.pipeline.precision, devices[0]):
        sample = meta_sample(inputs, min_micro)
        layers = per_sample(measure_layers(meta_copy(model), sample), min_micro)
        threads = threads_per_worker(devices)
        timer = LayerTimer(model, devices[0], inputs, targets, loss_fn, threads, init=init)
        timer.calibrate(micro)
        schedule = build_schedule("gpipe", len(devices), 4)
        overhead = executor_overhead(schedule, [torch.device(d) for d in devices], threads, 2)
    return layers, timer, overhead


def describe(
    best: Candidate, hardware: Hardware, fitting: int, sharding: ShardingChoice, why: str
) -> dict[str, Any]:
    """The choice as summary.json records it (pipeline/plan_choice); ``replica_sharding`` is
    None with one replica (the config's then stands: nothing is sharded), the link bandwidth
    None where no boundary crosses between devices."""
    link = hardware.link_bandwidth
    return {
        "schedule": best.schedule,
        "virtual_stages": best.virtual_stages,
        "chunks": best.chunks,
        "recompute": best.recompute,
        "balance": list(best.balance),
        "predicted_samples_per_s": best.samples_per_s,
        "predicted_step_time_s": best.step_time_s,
        "predicted_bubble": best.bubble,
        "predicted_peak_memory_bytes": list(best.peak_memory_bytes),
        "memory_budget_bytes": int(hardware.memory_bytes),
        "link_bandwidth_bytes_per_s": link if math.isfinite(link) else None,
        "configurations_fitting": fitting,
        "replicas": sharding.replicas,
        "replica_sharding": sharding.mode if sharding.replicas > 1 else None,
        "replica_sharding_why": why,
    }


def _nothing_fits(none: Ranked, spec: DeviceSpec, size: int, k: int) -> ConfigError:
    budget = spec.memory_bytes / GIB
    problem = f"{budget:.3g} GiB per device fits no plan for batch {size} on {k} devices"
    lean = none.leanest
    if lean is not None:
        need = lean.peak_bytes / (1 - spec.reserve)
        problem += (
            f"; the leanest ({lean.schedule}, M={lean.chunks}, recompute={lean.recompute}) "
            f"needs {need / GIB:.3g} GiB"
        )
    return ConfigError(
        "pipeline.memory_budget_gib",
        problem + ": raise it, add devices (pipeline.num_devices) or lower data.batch_size",
    )


# --------------------------------------------------------------------------- search space


def chunk_options(size: int, min_micro: int = 1) -> list[int]:
    """M to try: the divisors of the batch size that leave ``min_micro`` samples or more per
    micro-batch (every micro-batch then has the same size).

    >>> chunk_options(12), chunk_options(12, min_micro=2)
    ([1, 2, 3, 4, 6, 12], [1, 2, 3, 4, 6])
    """
    found = [m for m in range(1, size + 1) if size % m == 0 and size // m >= min_micro]
    return found or [1]


def has_batchnorm(model: nn.Module) -> bool:
    """Whether the model normalizes by batch statistics (a micro-batch then needs 2 samples)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def optimizer_slots(optim: OptimConfig) -> int:
    """Tensors of optimizer state per parameter: Adam(W) 2; RMSProp 1 (+1 with momentum);
    SGD 1 with momentum, else 0.

    >>> optimizer_slots(OptimConfig(name="adamw")), optimizer_slots(OptimConfig(name="sgd"))
    (2, 0)
    """
    momentum = 1 if optim.momentum > 0 else 0
    return {"adam": 2, "adamw": 2, "rmsprop": 1 + momentum}.get(optim.name, momentum)


def memory_budget(cfg: PipelineConfig, devices: Sequence[str], sharing: int | None = None) -> float:
    """Bytes per device: pipeline.memory_budget_gib, else the smallest GPU's memory of
    ``devices``, else (CPU stand-ins) the machine's RAM over ``sharing`` (default: the number
    of devices), the pipeline devices that share it."""
    if cfg.memory_budget_gib is not None:
        return cfg.memory_budget_gib * GIB
    gpus = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    if gpus:
        return float(min(torch.cuda.get_device_properties(d).total_memory for d in gpus))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / (sharing or len(devices))


def threads_per_worker(devices: Sequence[str]) -> int | None:
    """Intra-op threads of each worker, as the engine sets them (CPU stand-ins share cores)."""
    cpu = sum(torch.device(d).type == "cpu" for d in devices)
    return max(1, torch.get_num_threads() // cpu) if cpu > 1 else None
