"""``trainer.dry_run=true``: the run's plan, memory per device and step time, forecast with the
model on the meta device; nothing is trained or saved, and the command exits 0.

Example::

    summary = dry_run(cfg)    # prints the three lines; docs/running.md ("Pre-flight")
    summary["pipeline/predicted_peak_memory_bytes"]
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.config.checks import human_bytes
from giantpipe.perf.costs import DeviceModel, LayerCost
from giantpipe.perf.planner import LayerTimes
from giantpipe.runner.build import build_bundle
from giantpipe.runner.model import build_model
from giantpipe.runner.pipeline import worker_devices
from giantpipe.runner.preflight import RunForecast, forecast_run, refusal
from giantpipe.runner.world import World


def measured_device(device: str, sharing: int) -> DeviceModel:
    """``device``'s matmul FLOP/s and copy bandwidth, timed on a few small tensors, shared by
    ``sharing`` workers (CPU stand-ins share cores and memory bandwidth)."""
    on = torch.device(device)
    a, b = torch.randn(512, 512, device=on), torch.randn(512, 512, device=on)
    block, into = torch.zeros(4 * 2**20, device=on), torch.zeros(4 * 2**20, device=on)

    def timed(work: Any, repeats: int = 5) -> float:
        work()  # warm-up
        if on.type == "cuda":
            torch.cuda.synchronize(on)
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        if on.type == "cuda":
            torch.cuda.synchronize(on)
        return (time.perf_counter() - start) / repeats

    flops = 2 * 512**3 / timed(lambda: a @ b)
    bandwidth = 2 * block.numel() * block.element_size() / timed(lambda: into.copy_(block))
    return DeviceModel(
        peak_flops=flops / sharing, memory_bandwidth=bandwidth / sharing, efficiency=1.0
    )


def dry_run(cfg: ExperimentConfig) -> dict[str, Any]:
    """Forecast the run in this process and print it; a forecast that does not fit prints the
    refusal's reasons too (the dry run still exits 0: it only reports)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "trainer.dry_run",
            "runs in one process: start it without torchrun (python train.py ... "
            "trainer.dry_run=true); it forecasts every device of the pipeline",
        )
    world = World()
    devices, _ = worker_devices(cfg.pipeline, world)
    with torch.device("cpu"):  # data is made on the host, whatever the default device
        bundle = build_bundle(cfg, None)
    rate = measured_device(devices[0], sum(d == "cpu" for d in devices) or 1)

    def times(layers: list[LayerCost]) -> LayerTimes:
        return rate.layer_times(layers)

    fit = forecast_run(cfg, bundle, devices, world, lambda: build_model(cfg, bundle).layers, times)
    if fit is None:
        raise ConfigError(
            "trainer.dry_run", "the model cannot be sized on the meta device (see the warning)"
        )
    for line in report(cfg, fit, rate):
        print(line, flush=True)
    outcome = fit.outcome
    return {
        "status": "dry_run",
        "pipeline/balance": list(outcome.spec.balance),
        "pipeline/chunks": outcome.spec.chunks,
        "pipeline/predicted_peak_memory_bytes": list(outcome.simulation.peak_memory_bytes),
        "pipeline/predicted_step_time_s": outcome.simulation.step_time,
        "pipeline/predicted_bubble": outcome.simulation.bubble,
        "pipeline/fits": outcome.fits,
    }


def report(cfg: ExperimentConfig, fit: RunForecast, rate: DeviceModel) -> list[str]:
    """The dry run's lines: plan, memory, step time (and why it does not fit, if so)."""
    outcome, sized = fit.outcome, fit.sized
    spec, sim = outcome.spec, outcome.simulation
    peaks = ", ".join(human_bytes(p) for p in sim.peak_memory_bytes)
    verdict = "fits" if outcome.fits else "DOES NOT FIT"
    samples = sim.samples_per_second(sized.batch * sized.replicas)
    lines = [
        f"dry run of {cfg.name}: forecast on the meta device ({fit.seconds:.1f}s); nothing "
        "trained, nothing saved",
        f"  plan       K={spec.num_workers}, balance {list(spec.balance)} ({outcome.how}), "
        f"schedule {spec.schedule}, M={spec.chunks}, recompute {spec.recompute}, "
        f"batch {sized.batch * sized.replicas}",
        f"  memory     peak per device {peaks} (weights, gradients, optimizer state, "
        f"activations) on {fit.memory.described}: {verdict}",
        f"  step time  {sim.step_time:.3g} s, bubble {sim.bubble:.2f}, {samples:.4g} samples/s "
        f"(simulated from FLOPs and bytes at this device's measured "
        f"{rate.peak_flops / 1e9:.3g} GFLOP/s and {rate.memory_bandwidth / 1e9:.3g} GB/s "
        "per worker)",
    ]
    if not outcome.fits:
        lines.append(f"  why        {refusal(cfg.name, cfg.pipeline, fit).problem}")
    return lines
