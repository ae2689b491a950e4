"""The replica sharding ``pipeline.plan=auto`` picks: the least sharded mode that fits.

With R > 1 replicas, the first mode of :data:`SHARDING_ORDER` under which some configuration
fits the budget is taken (why that order: docs/timing-and-planner.md, "Replica sharding").

Example::

    >>> from giantpipe.perf.costs import LayerCost
    >>> from giantpipe.perf.planner import DeviceSpec, plan
    >>> layer = LayerCost(1e6, 2**18, 2**20, 64, 64, 0, 64)     # 1 MiB of weights
    >>> device = DeviceSpec(1e12, memory_bytes=14 * 2**20, link_bandwidth=1e9, reserve=0.0)
    >>> choice = choose_sharding(lambda s: plan([layer] * 8, 2, 4, device, replicas=s), 2)
    >>> choice.mode, [(mode, round(need / 2**20)) for mode, need in choice.ruled_out]  # MiB
    ('full', [('none', 16), ('grads', 14)])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from giantpipe.perf.planner import Ranked
from giantpipe.perf.replica_state import ReplicaSharding

GIB = 2**30

SHARDING_ORDER = ("none", "grads", "full")
"""Least sharded first: whole copies, then ZeRO-2, then ZeRO-3."""


@dataclass(frozen=True)
class ShardingChoice:
    """The mode taken, the plan's candidates under it, and each mode tried before it with the
    peak bytes its leanest configuration needs on its fullest device (None: it has none)."""

    mode: str
    replicas: int
    candidates: Ranked
    ruled_out: tuple[tuple[str, int | None], ...] = ()

    def why(self, budget: float, reserve: float = 0.0) -> str:
        """The choice in words, for the log and summary.json; ``budget``: bytes per device,
        ``reserve``: the share of it kept free (:class:`~giantpipe.perf.planner.DeviceSpec`)."""
        if self.replicas == 1:
            return "one replica: nothing to shard"
        over = [
            f"{mode} needs {_size(need / (1 - reserve))} a device at its leanest"
            if need is not None
            else f"{mode} has no configuration"
            for mode, need in self.ruled_out
        ]
        head = "; ".join(over) + f", over the budget of {_size(budget)}; " if over else ""
        verdict = "fits" if self.candidates else "does not fit either"
        least = "" if over else " (the least sharded mode)"
        return f"{head}{self.mode}{least} {verdict}"


def choose_sharding(search: Callable[[ReplicaSharding], Ranked], replicas: int) -> ShardingChoice:
    """The least sharded mode under which ``search`` (the planner, given a sharding) finds a
    configuration that fits; if none does, the most sharded one with its empty answer."""
    ruled_out: list[tuple[str, int | None]] = []
    *lesser, most = SHARDING_ORDER
    for mode in lesser:
        candidates = search(ReplicaSharding(replicas, mode))
        if candidates:
            return ShardingChoice(mode, replicas, candidates, tuple(ruled_out))
        lean = candidates.leanest
        ruled_out.append((mode, None if lean is None else lean.peak_bytes))
    return ShardingChoice(most, replicas, search(ReplicaSharding(replicas, most)), tuple(ruled_out))


def _size(n: float) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / 2**20:.3g} MiB"
