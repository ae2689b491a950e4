"""Each stage spread over its replicas on FSDP2: one step equals the plain model on the whole
mini-batch, for every schedule and sharding mode, at K=2 x R=2 and K=1 x R=4.

Loss, every rank's shard of every gradient, deferred BatchNorm's running statistics and the
dropout masks (each replica's own, as the engine seeds them) against the plain model; the
all-gathers and reduces per FSDP2 unit and step each mode makes (replica_workers.py); a weight
tied across the first and last stage, clipped by the global norm. One set of processes per
world runs every case (start-up is the expensive part).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.export import merged
from giantpipe.checkpoint.manifest import read_manifest
from giantpipe.checkpoint.storage import read_metadata
from tests.distributed.workers import registered_schedules
from tests.support.ranks import spawn

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
            ("memory", {"workers": 2, "shardings": SHARDINGS}),
        ],
    )
    grid = results[0][0]
    for sharding in SHARDINGS:
        assert schedules_checked(grid, sharding) == set(registered_schedules()), sharding
    held = {s: sum(h for what, _, h in grid["checked"] if what.startswith(s)) for s in SHARDINGS}
    assert held["full"] == held["grads"] < 0.6 * held["none"]  # a shard: about 1/R of a stage
    assert all(r[1]["tied"] and r[2]["tied"] == 0 for r in results)  # zb-v: one rank holds both
    for rank in results:  # parameters, gradients and AdamW's moments over the un-sharded bytes
        ratios = rank[3]
        assert 0.45 < ratios["full"] == ratios["grads"] < 0.6, ratios  # 1/R, AdamW's step counters
        assert 1.0 <= ratios["none"] < 1.05, ratios


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


def test_a_sharded_checkpoint_resumes_under_another_k_r_and_sharding(tmp_path: Path) -> None:
    """Saved by K=2 x R=2 ``full`` (every rank its own shards: a weight's rows come from two
    files), resumed under K=1 x R=4 ``grads``, K=4 x R=1 and K=2 x R=2 ``none``: each resumed
    run's losses (AdamW's moments, the EMA and the data position restored) equal the
    uninterrupted run's; consolidate gives the plain model's weights, gathered by no rank."""
    target = "tests.distributed.replica_workers:resume_across_layouts"
    results = spawn(target, world=4, tmp=tmp_path, timeout=300)
    out = results[0]
    run = out["run"]
    assert len(run["train"]) == 4
    for name in ("k1r4_grads", "k4r1", "k2r2_none"):
        assert out[name]["train"] == pytest.approx(run["train"][2:], rel=1e-5), name
        assert out[name]["eval"] == pytest.approx(run["eval"], rel=1e-5), name
    ckpt = tmp_path / "run" / "step_2"
    meta = read_metadata(ckpt, read_manifest(ckpt))
    weight = meta.state_dict_metadata["0.0.weight"]  # the first Linear: 16 rows, 8 per replica
    assert sorted(tuple(c.offsets) for c in weight.chunks) == [(0, 0), (8, 0)]
    moment = meta.state_dict_metadata["optimizer/0.0.weight/exp_avg"]
    assert len(moment.chunks) == 2  # AdamW's state, sharded as its parameter
    last = tmp_path / "run" / "last"
    consolidated, _ = merged(last)
    weights = {k: v for r in results for k, v in r["weights"].items()}
    assert consolidated.keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(consolidated[name], value, rtol=0, atol=0, msg=name)
