"""Each stage spread over its replicas on FSDP2: one step equals the plain model on the whole
mini-batch, for every schedule and sharding mode, at K=2 x R=2 and K=1 x R=4.

Loss, every rank's shard of every gradient, deferred BatchNorm's running statistics and the
dropout masks (each replica's own, as the engine seeds them) against the plain model; one
all-gather and one reduce per FSDP2 unit per step (none per micro-batch); a weight tied across
the first and last stage, clipped by the global norm. One set of processes per world runs every
case (start-up is the expensive part).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launch import spawn
from tests.distributed.workers import registered_schedules

pytestmark = pytest.mark.distributed

SHARDINGS = ["full", "grads", "none"]


def schedules_checked(grid: dict, sharding: str) -> set[str]:
    return {what.split(" ")[1] for what, _, _ in grid["checked"] if what.startswith(sharding)}


def test_two_stages_times_two_replicas_every_schedule_and_sharding(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.replica_workers:several",
        world=4,
        tmp=tmp_path,
        timeout=300,
        calls=[
            ("grid", {"workers": 2, "shardings": SHARDINGS}),
            ("tied", {"workers": 2, "schedule": "1f1b"}),
            ("tied", {"workers": 2, "schedule": "zb-v", "sharding": "grads"}),
        ],
    )
    grid = results[0][0]
    for sharding in SHARDINGS:
        assert schedules_checked(grid, sharding) == set(registered_schedules()), sharding
    held = {s: sum(h for what, _, h in grid["checked"] if what.startswith(s)) for s in SHARDINGS}
    assert held["full"] == held["grads"] < 0.6 * held["none"]  # a shard: about 1/R of a stage
    assert all(r[1]["tied"] and r[2]["tied"] == 0 for r in results)  # zb-v: one rank holds both


def test_one_stage_times_four_replicas_every_schedule_and_sharding(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.replica_workers:several",
        world=4,
        tmp=tmp_path,
        timeout=300,
        calls=[
            ("grid", {"workers": 1, "shardings": SHARDINGS, "blocks": 3}),
            ("tied", {"workers": 1, "schedule": "gpipe"}),
        ],
    )
    grid = results[0][0]
    for sharding in SHARDINGS:
        assert schedules_checked(grid, sharding) == set(registered_schedules()), sharding
    assert all(r[1]["tied"] == 0 for r in results)  # one stage holds both uses: one unit
