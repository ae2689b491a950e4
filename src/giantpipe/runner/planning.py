"""``pipeline.plan=auto``: the planner (:mod:`giantpipe.perf.planner`) on the run's own model and
devices.

What goes in, all measured on this run rather than assumed:

- bytes per layer (parameters, saved activations, boundary tensors) from the model copied to
  the meta device, one sample (:func:`giantpipe.perf.costs.measure_layers`);
- seconds per layer (forward, input gradient, weight gradient) on the first device, at the
  smallest and the largest micro-batch of the search, interpolated linearly in between
  (:class:`LayerTimer`), and the executor's cost per action;
- the optimizer's state per parameter (``optim.name``, ``optim.momentum``), the batch size of
  the data (M is searched over the divisors of it) and ``pipeline.memory_budget_gib``.

The measurements themselves are in :mod:`giantpipe.perf.costs`; this module is the glue from the
config to them and to the planner.

Not modelled: CPU stand-ins slowing each other down (they share cores), allocator slack.

Example::

    spec, choice = plan_pipeline(cfg, model, ["cpu", "cpu"], inputs, targets, loss_fn)
    spec.balance, spec.chunks, spec.recompute, spec.schedule     # what GPipe(spec=spec) runs
    as_run(cfg, spec)                      # the config as run (the record's config)
    choice["predicted_samples_per_s"]
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, OptimConfig, PipelineConfig
from giantpipe.data.bundle import Tensors, batch_size
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
from giantpipe.perf.planner import Candidate, DeviceSpec, format_table, plan, progress_bar
from giantpipe.perf.predict import executor_overhead
from giantpipe.perf.replica_state import ReplicaSharding
from giantpipe.runner.losses import LossFn
from giantpipe.runner.step import autocast

log = logging.getLogger(__name__)

GIB = 2**30
TOP = 5
"""Rows of the candidates table in the log."""


def plan_pipeline(
    cfg: ExperimentConfig,
    model: nn.Sequential,
    devices: list[str],
    inputs: Tensors,
    targets: Tensors,
    loss_fn: LossFn,
    replicas: int = 1,
) -> tuple[PipelineSpec, dict[str, Any]]:
    """The planner's spec (its balance, chunks, recompute, schedule and V; the config's
    timeout and deferred BatchNorm; ``devices``), and the choice as a dict for summary.json.
    ``inputs`` and ``targets`` are one training batch; under torchrun each of the
    ``replicas`` pipelines takes its share of it, and holds its stages' state as
    ``pipeline.replica_sharding`` spreads it (:mod:`giantpipe.perf.replica_state`).

    Leaves the model's parameters, gradients, buffers and the RNG streams as they were.
    """
    started = time.perf_counter()
    size, k = max(1, batch_size(inputs) // replicas), len(devices)
    min_micro = 2 if has_batchnorm(model) else 1
    chunks = chunk_options(size, min_micro)
    budget = memory_budget(cfg.pipeline, devices)
    layers, timer, overhead = _measure(cfg, model, devices, inputs, targets, loss_fn, chunks)
    spec = DeviceSpec(
        peak_flops=1.0,  # unused: layer times are measured
        memory_bytes=budget,
        link_bandwidth=link_bandwidth(devices),
        link_latency=0.0,
    )
    search = functools.partial(
        plan,
        layers,
        k,
        size,
        chunks=chunks,
        optimizer_slots=optimizer_slots(cfg.optim),
        layer_times=timer,
        overhead=overhead,
        replicas=ReplicaSharding(replicas, cfg.pipeline.replica_sharding),
    )
    with progress_bar() as progress:
        candidates = search(spec, top=TOP, progress=progress)
    if not candidates:
        raise _nothing_fits(search(replace(spec, memory_bytes=math.inf)), spec, size, k)
    best = candidates[0]
    seconds = time.perf_counter() - started
    log.info(
        "pipeline.plan=auto (%.1fs): %d configurations fit %.3g GiB per device (batch %d, K=%d, "
        "M in %s); the best %d, by simulation on measured layer times:\n%s",
        *(seconds, candidates.fitting, budget / GIB, size, k, chunks, len(candidates)),
        format_table(candidates[:TOP]),
    )
    chosen = best.spec(
        devices=tuple(devices),
        timeout=cfg.pipeline.timeout,
        deferred_batch_norm=cfg.pipeline.deferred_batch_norm,
    )
    return chosen, describe(best, budget, candidates.fitting)


def as_run(cfg: ExperimentConfig, spec: PipelineSpec) -> ExperimentConfig:
    """The experiment config as run, what the run's record logs: under plan=auto the planner's
    knobs (``spec``'s balance, M, recompute, schedule and V) in place of the config's; else
    ``cfg`` itself.

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
    )
    return replace(cfg, pipeline=pipeline)


def _measure(
    cfg: ExperimentConfig,
    model: nn.Sequential,
    devices: list[str],
    inputs: Tensors,
    targets: Tensors,
    loss_fn: LossFn,
    chunks: list[int],
) -> tuple[list[LayerCost], LayerTimer, float]:
    """Bytes per layer and sample, seconds per layer (at the smallest and largest micro-batch)
    and the executor's cost per action, the RNG streams left as they were."""
    size, min_micro = batch_size(inputs), 2 if has_batchnorm(model) else 1
    cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    with torch.random.fork_rng(devices=cuda), autocast(cfg.pipeline.precision, devices[0]):
        sample = meta_sample(inputs, min_micro)
        layers = per_sample(measure_layers(meta_copy(model), sample), min_micro)
        threads = threads_per_worker(devices)
        timer = LayerTimer(model, devices[0], inputs, targets, loss_fn, threads)
        timer.calibrate([size // max(chunks), size // min(chunks)])
        schedule = build_schedule("gpipe", len(devices), 4)
        overhead = executor_overhead(schedule, [torch.device(d) for d in devices], threads, 2)
    return layers, timer, overhead


def describe(best: Candidate, budget: float, fitting: int) -> dict[str, Any]:
    """The choice as summary.json records it (pipeline/plan_choice)."""
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
        "memory_budget_bytes": int(budget),
        "configurations_fitting": fitting,
    }


def _nothing_fits(unbounded: list[Candidate], spec: DeviceSpec, size: int, k: int) -> ConfigError:
    budget = spec.memory_bytes / GIB
    problem = f"{budget:.3g} GiB per device fits no plan for batch {size} on {k} devices"
    if unbounded:
        lean = min(unbounded, key=lambda c: max(c.peak_memory_bytes))
        need = max(lean.peak_memory_bytes) / (1 - spec.reserve)
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


def memory_budget(cfg: PipelineConfig, devices: Sequence[str]) -> float:
    """Bytes per device: pipeline.memory_budget_gib, else the smallest GPU's memory, else (CPU
    stand-ins) the machine's RAM over the number of devices."""
    if cfg.memory_budget_gib is not None:
        return cfg.memory_budget_gib * GIB
    gpus = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    if gpus:
        return float(min(torch.cuda.get_device_properties(d).total_memory for d in gpus))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / len(devices)


def threads_per_worker(devices: Sequence[str]) -> int | None:
    """Intra-op threads of each worker, as the engine sets them (CPU stand-ins share cores)."""
    cpu = sum(torch.device(d).type == "cpu" for d in devices)
    return max(1, torch.get_num_threads() // cpu) if cpu > 1 else None


def link_bandwidth(devices: Sequence[str]) -> float:
    """Bytes/s from the first device to the second, timed on a 64 MiB copy (inf: one device)."""
    src, dst = torch.device(devices[0]), torch.device(devices[-1])
    if src == dst:
        return math.inf
    block = torch.empty(16 * 2**20, device=src)
    block.to(dst)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    block.to(dst)
    torch.cuda.synchronize()
    return block.numel() * block.element_size() / (time.perf_counter() - start)
