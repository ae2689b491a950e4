"""The distributed executor equals the plain model and the local executor (GPipe).

Loss and every gradient, for every registered schedule (parametrised by the registry at run
time, so schedules added later are covered), K=2 and K=4 processes and K=2 x R=2 replicas, with
tuples, integer and bool tensors and shapes that change from step to step. Ranks are gloo
processes on loopback; each compares its own parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.workers import registered_schedules
from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed

MODES = ["except_last", "always", "never"]


def covered(results: list[dict], key: str = "checked") -> set[str]:
    return {what.split(" ")[0] for what, _ in results[0][key]}


def test_two_stages_every_schedule_and_mode_and_changing_shapes(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.workers:several",
        world=2,
        tmp=tmp_path,
        calls=[
            ("equivalence", {"workers": 2, "chunks": [1, 4], "modes": MODES}),
            ("shapes", {"workers": 2}),
        ],
    )
    checked = [r["equivalence"]["checked"] for r in results]
    assert {what.split(" ")[0] for what, _ in checked[0]} == set(registered_schedules())
    assert all(n > 0 for rank in checked for _, n in rank)  # every rank compared its params
    names = [set(r["shapes"]["names"]) for r in results]
    assert names[0] and names[1] and not names[0] & names[1]  # each holds only its own stage


def test_four_stages_every_schedule(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.workers:equivalence",
        world=4,
        tmp=tmp_path,
        workers=4,
        chunks=[4],
        modes=["except_last"],
    )
    assert covered(results) == set(registered_schedules())


def test_two_stages_times_two_replicas_clipping_and_accumulation(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.workers:several",
        world=4,
        tmp=tmp_path,
        calls=[
            (
                "equivalence",
                {
                    "workers": 2,
                    "chunks": [2],
                    "modes": ["except_last"],
                    "schedules": ["gpipe", "1f1b"],
                },
            ),
            ("clipping", {"workers": 2}),
            ("clipping_under_the_limit", {"workers": 2}),
            ("accumulation", {"workers": 2}),
            ("replicated_batch_norm", {"workers": 2}),
        ],
    )
    assert all("R=2" in what for what, _ in results[0]["equivalence"]["checked"])
    norms = {round(r["clipping"]["norm"], 5) for r in results}
    assert len(norms) == 1  # every rank of every replica clipped by the same global norm
    under = {round(r["clipping_under_the_limit"]["norm"], 5) for r in results}
    assert len(under) == 1 and all(r["clipping_under_the_limit"]["untouched"] for r in results)
    assert all(r["accumulation"]["checked"] > 0 for r in results)
    # running statistics of the whole batch on both replicas (compared by replicated_batch_norm)
    assert all(r["replicated_batch_norm"]["buffers"] > 0 for r in results)
