"""Pre-flight: before a run allocates its model, what each device will hold against what the
machine has; a run that cannot fit is refused in one line that names the keys that would fit it.

The model is built on the meta device and sized layer by layer (no tensor is allocated), the
pipeline's step is replayed by the simulator, and each device's peak is set against its GPU's
free memory or, for CPU stand-ins, the host's available memory they share
(:mod:`giantpipe.perf.fit`). How it decides, and ``trainer.memory_check=false`` to skip it:
docs/running.md ("Pre-flight").

Example::

    fit = forecast_run(cfg, bundle, devices, World(), lambda: build_model(cfg, bundle))
    refuse_unless_fits(cfg, fit)              # ConfigError (exit 2) when it cannot fit
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, PipelineConfig
from giantpipe.config.checks import human_bytes
from giantpipe.data.bundle import DataBundle, batch_size
from giantpipe.engine.spec import PipelineSpec, virtual_stages_of
from giantpipe.perf.balance import NoFit, solve_balance
from giantpipe.perf.costs import DeviceModel, LayerCost, measure_layers, meta_sample, per_sample
from giantpipe.perf.fit import Shortfall, forecast, shortfalls
from giantpipe.perf.planner import Candidate, DeviceSpec, LayerTimes, plan
from giantpipe.perf.replica_state import ReplicaSharding
from giantpipe.perf.simulate import Simulation
from giantpipe.runner.pipeline import pipeline_spec, rank_device
from giantpipe.runner.planning import chunk_options, has_batchnorm, optimizer_slots
from giantpipe.runner.step import autocast
from giantpipe.runner.world import World

log = logging.getLogger(__name__)

GIB = 2**30
NOMINAL = DeviceModel(peak_flops=1e12, memory_bandwidth=1e11)
"""Seconds that only rank the cuts of a check (the dry run measures the device's own rate)."""


@dataclass(frozen=True)
class Sized:
    """The model as the forecast sees it: bytes and FLOPs per layer and sample, one replica's
    mini-batch, the least samples per micro-batch (2 with BatchNorm) and optimizer slots."""

    layers: list[LayerCost]
    batch: int
    min_micro: int
    slots: int
    replicas: int


@dataclass(frozen=True)
class Memory:
    """What the workers draw on: (worker, pool) per device of this host that this process
    checks, and each pool's bytes (:func:`giantpipe.perf.fit.shortfalls`)."""

    members: list[tuple[int, str]]
    capacity: dict[str, float]
    described: str

    def widened(self, workers: int) -> Memory:
        """The same machine with ``workers`` devices like these: stand-ins share the host, GPUs
        each bring their own (the smallest's)."""
        if set(self.capacity) == {"host"}:
            return replace(self, members=[(w, "host") for w in range(workers)])
        least = min(self.capacity.values())
        pools = {f"device {w}": least for w in range(workers)}
        return replace(self, members=[(w, f"device {w}") for w in range(workers)], capacity=pools)


@dataclass(frozen=True)
class Outcome:
    """One pipeline's forecast: its spec (the planner's, or the leanest one when none fits),
    the simulated step, where the balance came from, and the pools it overflows."""

    spec: PipelineSpec
    simulation: Simulation
    how: str
    short: list[Shortfall]

    @property
    def fits(self) -> bool:
        return not self.short


@dataclass(frozen=True)
class RunForecast:
    """The run's own outcome, the machine's memory, and the model as sized."""

    outcome: Outcome
    memory: Memory
    sized: Sized
    seconds: float


def size_model(
    cfg: ExperimentConfig,
    bundle: DataBundle,
    build: Callable[[], nn.Sequential],
    replicas: int,
    flops: bool = False,
) -> Sized:
    """``build()`` on the meta device, measured on one meta sample of the first training batch
    (bytes; FLOPs too with ``flops``); every random stream is left as it was (the real build
    comes next)."""
    inputs, _ = bundle.first_batch(cfg.trainer.seed)
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build()
            min_micro = 2 if has_batchnorm(model) else 1
            with autocast(cfg.pipeline.precision, "cpu"):
                layers = measure_layers(
                    model.train(), meta_sample(inputs, min_micro), count_flops=flops
                )
    finally:
        random.setstate(state)
    return Sized(
        per_sample(layers, min_micro),
        max(1, batch_size(inputs) // replicas),
        min_micro,
        optimizer_slots(cfg.optim),
        replicas,
    )


def host_available() -> int:
    """Bytes of host memory available now (``MemAvailable``: free plus what the kernel can
    reclaim), else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def machine_memory(cfg: PipelineConfig, devices: Sequence[str], world: World) -> Memory:
    """The pools this process checks: its own GPUs' free memory (never another rank's device),
    the host's available memory for its CPU stand-ins and every CPU rank of this host, or
    ``pipeline.memory_budget_gib`` per device when set."""
    k, mine = len(devices), checked_devices(cfg, devices, world)
    if cfg.memory_budget_gib is not None:
        budget = cfg.memory_budget_gib * GIB
        return Memory(
            [(w, f"device {w}") for w, _ in mine],
            {f"device {w}": budget for w, _ in mine},
            f"{k} devices of pipeline.memory_budget_gib={cfg.memory_budget_gib:g}",
        )
    members, capacity = [], {}
    for w, name in mine:
        device = torch.device(name)
        if device.type == "cuda":
            pool = str(device)
            capacity[pool] = float(torch.cuda.mem_get_info(device)[0])
        else:
            pool = "host"
            capacity.setdefault(pool, float(host_available()))
        members.append((w, pool))
    return Memory(members, capacity, _described(devices, capacity))


def checked_devices(
    cfg: PipelineConfig, devices: Sequence[str], world: World
) -> list[tuple[int, str]]:
    """(worker, device) of each device this process answers for: the K of the local executor;
    under torchrun its own (never another rank's GPU) or, on a CPU host, every local rank's
    (rank r runs worker r % K: replica 0's ranks are 0..K-1).

    Example::

        checked_devices(PipelineConfig(devices="cpu"), ["cpu", "cpu"], World())
        # [(0, "cpu"), (1, "cpu")]
    """
    k = len(devices)
    if world.size == 1:
        return list(enumerate(devices))
    own = rank_device(cfg, torch.cuda.device_count())
    if own != "cpu":
        return [(world.rank % k, own)]
    first = world.rank - int(os.environ.get("LOCAL_RANK", 0))
    ranks = range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return [(r % k, "cpu") for r in ranks]


def _described(devices: Sequence[str], capacity: dict[str, float]) -> str:
    cpu = sum(d == "cpu" for d in devices)
    if cpu == len(devices):
        visible = torch.cuda.device_count()
        why = "no GPU visible" if visible == 0 else "pipeline.devices=cpu"
        return (
            f"{len(devices)} CPU stand-in devices ({why}) sharing "
            f"{human_bytes(capacity['host'])} of available host memory"
        )
    gpus = {p: c for p, c in capacity.items() if p != "host"}
    name = torch.cuda.get_device_name(torch.device(next(iter(gpus)))) if gpus else "GPU"
    free = ", ".join(human_bytes(c) for c in gpus.values())
    return f"{len(devices)} devices ({name}; free here: {free})"


def evaluate(
    pcfg: PipelineConfig, sized: Sized, k: int, memory: Memory, times: LayerTimes
) -> Outcome | None:
    """The forecast of ``pcfg`` on ``k`` workers: its own balance (a listed one, or by
    parameters), or the cut the planner finds (``plan=auto``; the ``time`` and ``memory``
    policies, which profile real layers, by FLOPs here). None: a spec the run's own checks
    refuse (they say why)."""
    layers, sharding = sized.layers, ReplicaSharding(sized.replicas, pcfg.replica_sharding)
    v = virtual_stages_of(pcfg.schedule, pcfg.virtual_stages)
    if pcfg.plan == "auto" or pcfg.balance in ("time", "memory"):
        return _planned(pcfg, sized, k, memory, times, sharding)
    if isinstance(pcfg.balance, list | tuple):
        balance, how = list(pcfg.balance), "listed balance"
    else:
        try:
            balance = solve_balance([float(c.params) for c in layers], k * v)
        except (NoFit, ValueError):
            return None
        how = "balance by parameters"
    try:
        spec = pipeline_spec(pcfg, balance)
        spec.check_against(len(layers), k)
    except (ConfigError, ValueError):
        return None
    sim = forecast(layers, spec, sized.batch, sized.slots, times, sharding)
    return Outcome(
        spec, sim, how, shortfalls(sim.peak_memory_bytes, memory.members, memory.capacity)
    )


def _planned(
    pcfg: PipelineConfig,
    sized: Sized,
    k: int,
    memory: Memory,
    times: LayerTimes,
    sharding: ReplicaSharding,
) -> Outcome | None:
    """The planner's fastest configuration that fits (every one under plan=auto, else the
    config's schedule, M and mode), or its leanest when none does."""
    search = functools.partial(
        plan,
        sized.layers,
        k,
        sized.batch,
        optimizer_slots=sized.slots,
        layer_times=times,
        replicas=sharding,
    )
    if pcfg.plan == "auto":
        how = "plan=auto"
        search = functools.partial(search, chunks=chunk_options(sized.batch, sized.min_micro))
    else:
        how = f"balance={pcfg.balance}, cut by FLOPs here"
        search = functools.partial(
            search,
            schedules=[pcfg.schedule],
            virtual_stages=[virtual_stages_of(pcfg.schedule, pcfg.virtual_stages)],
            chunks=[pcfg.chunks],
            recompute=[pcfg.recompute],
        )
    share = min(
        memory.capacity[p] / sum(q == p for _, q in memory.members) for _, p in memory.members
    )
    device = DeviceSpec(
        peak_flops=1.0, memory_bytes=share, link_bandwidth=math.inf, link_latency=0.0, reserve=0.0
    )
    try:
        found: list[Candidate] = search(device, top=1)
        if not found:  # none fits: the leanest, to say how far off it is
            found = sorted(
                search(replace(device, memory_bytes=math.inf)),
                key=lambda c: max(c.peak_memory_bytes),
            )[:1]
            how += ", its leanest"
    except ValueError:
        return None
    if not found:
        return None
    best: Candidate = found[0]
    spec = best.spec()
    return Outcome(
        spec,
        best.simulation,
        how,
        shortfalls(best.peak_memory_bytes, memory.members, memory.capacity),
    )


def forecast_run(
    cfg: ExperimentConfig,
    bundle: DataBundle,
    devices: Sequence[str],
    world: World,
    build: Callable[[], nn.Sequential],
    times: Callable[[list[LayerCost]], LayerTimes] | None = None,
) -> RunForecast | None:
    """The run's forecast, or None (logged) when the model cannot be sized on the meta device
    (the run then goes on unchecked). ``times``: seconds per layer from its costs, for a step
    time worth reading (FLOPs are then counted too); else bytes only, as the check needs."""
    started = time.perf_counter()
    k = len(devices)
    replicas = world.size // k if world.size > 1 and world.size % k == 0 else 1
    try:
        sized = size_model(cfg, bundle, build, replicas, flops=times is not None)
    except Exception as err:  # noqa: BLE001 - a model the meta device cannot build: say so, go on
        log.warning(
            "pre-flight skipped: the model cannot be sized on the meta device (%s: %s)",
            type(err).__name__,
            err,
        )
        return None
    memory = machine_memory(cfg.pipeline, devices, world)
    outcome = evaluate(cfg.pipeline, sized, k, memory, (times or NOMINAL.layer_times)(sized.layers))
    if outcome is None:
        return None
    return RunForecast(outcome, memory, sized, time.perf_counter() - started)


def remedies(cfg: PipelineConfig, fit: RunForecast) -> list[str]:
    """The single changes predicted to fit: more micro-batches, re-materialization, the
    planner, more devices, a smaller batch (the first value of each that fits)."""
    sized, memory, found = fit.sized, fit.memory, []
    k = fit.outcome.spec.num_workers
    times = NOMINAL.layer_times(sized.layers)

    def fits(pcfg: PipelineConfig, workers: int = k, batch: int = sized.batch) -> bool:
        wider = memory if workers == k else memory.widened(workers)
        outcome = evaluate(pcfg, replace(sized, batch=batch), workers, wider, times)
        return outcome is not None and outcome.fits

    if cfg.plan != "auto":
        if cfg.recompute != "always" and fits(replace(cfg, recompute="always")):
            found.append("pipeline.recompute=always")
        more = [m for m in chunk_options(sized.batch, sized.min_micro) if m > cfg.chunks]
        chunks = next((m for m in more if fits(replace(cfg, chunks=m))), None)
        if chunks is not None:
            found.append(f"pipeline.chunks={chunks}")
        if fits(replace(cfg, plan="auto")):
            found.append("pipeline.plan=auto")
    if not isinstance(cfg.balance, list | tuple):
        v = virtual_stages_of(cfg.schedule, cfg.virtual_stages)
        wider = [n for n in (2 * k, 4 * k, 8 * k) if n * v <= len(sized.layers)]
        workers = next((n for n in wider if fits(replace(cfg, num_devices=n), workers=n)), None)
        if workers is not None:
            found.append(f"pipeline.num_devices={workers}")
    least = cfg.chunks * sized.min_micro if cfg.plan != "auto" else sized.min_micro
    smaller = [sized.batch >> i for i in range(1, 12) if sized.batch >> i >= least]
    batch = next((b for b in smaller if fits(cfg, batch=b)), None)
    if batch is not None:
        found.append(f"data.batch_size={batch * sized.replicas}")
    return found


def refusal(name: str, cfg: PipelineConfig, fit: RunForecast) -> ConfigError:
    """The one line of a run that cannot fit: the hardware, the predicted peaks against what is
    there, and the keys that would fit it (or what it wants when no single key does)."""
    outcome, short = fit.outcome, fit.outcome.short[0]
    peaks = outcome.simulation.peak_memory_bytes
    spec = outcome.spec
    shape = f"{spec.schedule} M={spec.chunks} recompute={spec.recompute}, {outcome.how}"
    each = " + ".join(human_bytes(peaks[w]) for w in short.workers)
    problem = (
        f"recipe {name} does not fit: {fit.memory.described}; the step is predicted to need {each} "
        f"({shape}) where {human_bytes(short.have)} is there"
    )
    found = remedies(cfg, fit)
    if found:
        problem += "; predicted to fit with " + " or ".join(found)
    else:
        problem += (
            "; no single change of pipeline.num_devices, pipeline.chunks, pipeline.recompute, "
            f"pipeline.plan=auto or data.batch_size fits it here: it wants {len(peaks)} devices "
            f"of at least {human_bytes(max(peaks))} each (GPUs: pipeline.devices=cuda)"
        )
    # the budget a user set is the key; else the pipeline's shape is what does not fit
    key = "pipeline.memory_budget_gib" if cfg.memory_budget_gib is not None else "pipeline"
    return ConfigError(key, problem)


def check_fit(
    cfg: ExperimentConfig,
    bundle: DataBundle,
    devices: Sequence[str],
    world: World,
    build: Callable[[], nn.Sequential],
) -> None:
    """Refuse a run that cannot fit, before it allocates (``trainer.memory_check=false`` skips
    it); the check's own time is logged."""
    if not cfg.trainer.memory_check:
        return
    fit = forecast_run(cfg, bundle, devices, world, build)
    if fit is None:
        return
    log.debug("pre-flight: %.2fs, peaks %s", fit.seconds, fit.outcome.simulation.peak_memory_bytes)
    if not fit.outcome.fits:
        raise refusal(cfg.name, cfg.pipeline, fit)
