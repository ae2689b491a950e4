"""benchmarks/planner_memory.py: planning a model built on meta holds a layer at a time, not the
model (a fresh process's peak resident memory against the model's fp32 bytes; a model larger
than the process may grow by, under the kernel's limit)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/planner_memory.py")


@pytest.fixture(scope="module")
def on_meta(bench: ModuleType) -> dict[str, Any]:
    """One fresh process plans 2 GiB of layers (32 of 64 MiB) built on meta; the kernel lets it
    grow by 1 GiB after its imports (RLIMIT_DATA): less than the model, so only planning a layer
    at a time can complete. Both tests read this one run."""
    row: dict[str, Any] = bench.run(4096, 32, "meta", limit_gib=1.0)
    return row


def test_planning_a_model_on_meta_holds_far_less_than_the_model(on_meta: dict) -> None:
    assert on_meta["model_gib"] == pytest.approx(2.0, rel=0.01)
    # a layer (its copy, gradient and the copies a profile makes) and the interpreter's own
    # growth: the whole model alone would be 2 GiB
    assert on_meta["peak_gib"] < 0.5, on_meta
    assert sum(on_meta["balance"]) == 32


def test_a_model_larger_than_the_process_may_hold_is_planned(
    bench: ModuleType, on_meta: dict
) -> None:
    assert not on_meta.get("out_of_memory"), "planning a layer at a time needed more than 1 GiB"
    assert on_meta["model_gib"] == pytest.approx(2.0, rel=0.01)
    assert sum(on_meta["balance"]) == 32
    assert bench.run(4096, 32, "whole", limit_gib=1.0) == {"out_of_memory": True}  # it bites
