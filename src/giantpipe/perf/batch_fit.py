"""The batch that fits: the fastest batch of M micro-batches that a device's memory holds.

The GPipe paper adjusted each cell's batch "to fit memory" (Table 2). For K stages and M
micro-batches this search tries the batches M, 2M, 4M, ... up to a ceiling: for each, the
planner looks for a cut of the model whose every stage fits in a device's memory under the
re-materialization mode (:func:`~giantpipe.perf.planner.plan`, GPipe's schedule only); the first
batch with no such cut ends the search (a larger one needs more memory still), and of those that
fit, the one the caller's rate (samples/s of that cut at that batch) finds fastest wins.

Example::

    fit = fastest_batch(layers, 4, 32, device, model.layer_times(layers), rate, max_batch=4096)
    fit.batch, fit.samples_per_s, fit.balance          # e.g. 512, 1830.2, (7, 6, 6, 5)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from giantpipe.perf.costs import LayerCost
from giantpipe.perf.planner import DeviceSpec, LayerTimes, plan

Rate = Callable[[int, Sequence[int]], float]
"""``rate(batch, balance)``: samples/s of the model cut by ``balance`` at that batch."""


@dataclass(frozen=True)
class Fit:
    """The batch that fit, its throughput and balance."""

    batch: int
    samples_per_s: float
    balance: tuple[int, ...]


def fastest_batch(
    layers: Sequence[LayerCost],
    num_devices: int,
    chunks: int,
    device: DeviceSpec,
    layer_times: LayerTimes,
    rate: Rate,
    max_batch: int,
    recompute: str = "always",
) -> Fit | None:
    """The fastest batch ``chunks * 2^j`` up to ``max_batch`` that fits on ``num_devices``
    devices under ``recompute``, cut by the planner on ``layer_times`` and timed by ``rate``;
    None if not even ``chunks`` samples fit (or ``max_batch < chunks``)."""
    best, batch = None, chunks
    while batch <= max_batch:
        found = plan(layers, num_devices, batch, device, schedules=("gpipe",), chunks=(chunks,),
                     recompute=(recompute,), layer_times=layer_times)  # fmt: skip
        if not found:
            break  # larger batches need more memory still
        samples_per_s = rate(batch, found[0].balance)
        if best is None or samples_per_s > best.samples_per_s:
            best = Fit(batch, samples_per_s, tuple(found[0].balance))
        batch *= 2
    return best
