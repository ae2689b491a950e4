"""The bytes of a stage's training state a rank holds when the stage is spread over R replicas
on FSDP2 (``pipeline.replica_sharding``): at the step's peak, and between steps.

Per sharding mode, the table: docs/performance.md#a-replicas-share-of-a-stages-state.

Example::

    >>> full = ReplicaSharding(replicas=4, mode="full")
    >>> full.layer_bytes(1000, slots=2), full.gathered_bytes(500), full.rest_bytes(1000, slots=2)
    (1000.0, 1500, 1000.0)
    >>> ReplicaSharding(replicas=4, mode="grads").layer_bytes(1000, slots=2)
    3000.0
    >>> ReplicaSharding().layer_bytes(1000, slots=2)       # one replica: nothing spread
    4000.0
"""

from __future__ import annotations

from dataclasses import dataclass

from giantpipe.engine.spec import DEFAULT_REPLICA_SHARDING, check_replica_sharding

__all__ = ["ReplicaSharding", "keeps_units"]


def keeps_units(schedule: str) -> bool:
    """Whether ``full`` keeps a stage's units gathered through a step under ``schedule``: the
    zero-bubble schedules split the backward, and W needs the graph B kept.

    >>> keeps_units("zb-v"), keeps_units("1f1b")
    (True, False)
    """
    return schedule.startswith("zb")


@dataclass(frozen=True)
class ReplicaSharding:
    """R replicas of every stage and how each stage is spread over them."""

    replicas: int = 1
    mode: str = DEFAULT_REPLICA_SHARDING
    split: bool = False  # the schedule splits the backward (zb-h1, zb-v): see keeps_units

    def __post_init__(self) -> None:
        check_replica_sharding(self.mode)
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")

    @property
    def sharded(self) -> bool:
        """Whether parameters, gradients and optimizer state are split over the replicas."""
        return self.replicas > 1 and self.mode != "none"

    def layer_bytes(self, weights: float, slots: int) -> float:
        """A layer's state at the step's peak: ``weights`` bytes of parameters, ``slots``
        optimizer slots per parameter (docs/performance.md#a-replicas-share-of-a-stages-state)."""
        if self.replicas == 1:
            return float((2 + slots) * weights)
        if self.mode == "none":
            return float((3 + slots) * weights)
        # full (not zero bubble) reduces each micro-batch's gradients as its backward of a
        # layer ends: no layer is whole but the one gathered_bytes counts
        whole = 2 if self.mode == "grads" or self.split else 0
        return whole * weights + (2 + slots) * weights / self.replicas

    def gathered_bytes(self, largest: int) -> int:
        """What a stage holds besides its layers' :meth:`layer_bytes` at the peak: with
        ``full`` (not zero bubble) one unit gathered in its backward, its unsharded gradients
        and FSDP2's reduce-scatter input of the unit before (kept until this one reduces),
        each up to ``largest`` bytes (its largest layer's parameters); else nothing."""
        whole = self.sharded and self.mode == "full" and not self.split
        return 3 * largest if whole else 0

    def rest_bytes(self, weights: float, slots: int) -> float:
        """A layer's state between steps (after the optimizer's step, gradients kept)."""
        total = float((2 + slots) * weights)
        return total / self.replicas if self.sharded else total
