"""Whether a pipeline fits its devices: each device's predicted peak against the memory there.

A device draws on a memory *pool*: a GPU's own, or the host's RAM that every CPU stand-in (and
every torchrun rank) of the host shares. A run fits when each pool holds the peaks of its
members together (:func:`shortfalls`). The peaks are the simulator's, for a pipeline's spec,
from per-layer bytes measured on the meta device (:func:`forecast`). See docs/running.md
("Pre-flight").

>>> shortfalls([3, 2, 4], [(0, "host"), (1, "host"), (2, "cuda:0")], {"host": 4, "cuda:0": 4})
[Shortfall(pool='host', workers=(0, 1), need=5, have=4)]
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from giantpipe.engine.microbatch import split_sizes
from giantpipe.engine.spec import PipelineSpec
from giantpipe.perf.costs import LayerCost
from giantpipe.perf.planner import LayerTimes, combine
from giantpipe.perf.replica_state import ReplicaSharding, keeps_units
from giantpipe.perf.simulate import Simulation, StageCost, simulate


@dataclass(frozen=True)
class Shortfall:
    """A pool whose members' predicted peaks add up to more than it holds (bytes)."""

    pool: str
    workers: tuple[int, ...]
    need: int
    have: float


def shortfalls(
    peaks: Sequence[int], members: Sequence[tuple[int, str]], capacity: Mapping[str, float]
) -> list[Shortfall]:
    """The pools that cannot hold their members, in the order they first appear.

    ``peaks``: bytes per worker; ``members``: (worker, pool) for each device that draws on a
    pool (a worker may appear several times: two torchrun replicas of it on one host);
    ``capacity``: bytes per pool. A pool exactly full fits.
    """
    need: dict[str, int] = {}
    workers: dict[str, list[int]] = {}
    for worker, pool in members:
        need[pool] = need.get(pool, 0) + peaks[worker]
        workers.setdefault(pool, []).append(worker)
    return [
        Shortfall(pool, tuple(workers[pool]), need[pool], capacity[pool])
        for pool in need
        if need[pool] > capacity[pool]
    ]


def forecast(
    layers: Sequence[LayerCost],
    spec: PipelineSpec,
    batch_size: int,
    optimizer_slots: int,
    layer_times: LayerTimes,
    replicas: ReplicaSharding | None = None,
) -> Simulation:
    """The simulated step of ``spec`` (its own balance, M, schedule and re-materialization) on
    a model of ``layers`` (bytes per sample, :func:`~giantpipe.perf.costs.measure_layers`):
    peak bytes per worker and, from ``layer_times``, the step time and bubble. Each stage holds
    its layers' weights, gradients and ``optimizer_slots`` per parameter, as ``replicas``
    spreads them, as the planner counts them (:mod:`giantpipe.perf.planner`).
    """
    sharding = replace(replicas or ReplicaSharding(), split=keeps_units(spec.schedule))
    micro = split_sizes(batch_size, spec.chunks)[0]  # the largest micro-batch
    times = layer_times(micro)
    per_layer = [
        StageCost(
            forward=f,
            backward=b + w,
            backward_input=b,
            weight=w,
            input_bytes=c.input_bytes * micro,
            activation_bytes=c.saved_bytes * micro,
            static_bytes=int(sharding.layer_bytes(c.param_bytes, optimizer_slots)),
        )
        for c, (f, b, w) in zip(layers, times, strict=True)
    ]
    gathered = sharding.gathered_bytes(max((c.param_bytes for c in layers), default=0))
    bounds = list(itertools.accumulate([0, *spec.balance]))
    costs = [
        replace(s, static_bytes=s.static_bytes + gathered)
        for s in (
            combine(per_layer[a:b], layers[a:b], micro) for a, b in itertools.pairwise(bounds)
        )
    ]
    return simulate(spec.step_schedule(), costs, spec.recompute)
