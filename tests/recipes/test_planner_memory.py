"""benchmarks/planner_memory.py: planning a model built on meta holds a layer at a time, not the
model (a fresh process's peak resident memory against the model's fp32 bytes; a model larger
than the process may grow by, under the kernel's limit)."""

from __future__ import annotations

import pytest

from tests.support.scripts import load_script


def test_planning_a_model_on_meta_holds_far_less_than_the_model() -> None:
    bench = load_script("benchmarks/planner_memory.py")
    row = bench.run(4096, 16, "meta")  # 16 layers of 64 MiB: 1 GiB
    assert row["model_gib"] == pytest.approx(1.0, rel=0.01)
    # a layer (its copy, gradient and the copies a profile makes) and the interpreter's own
    # growth: the whole model alone would be 1 GiB
    assert row["peak_gib"] < 0.5, row
    assert sum(row["balance"]) == 16


def test_a_model_larger_than_the_process_may_hold_is_planned() -> None:
    bench = load_script("benchmarks/planner_memory.py")
    # 2 GiB of layers; the kernel lets each process grow by 1 GiB after its imports
    # (RLIMIT_DATA): less than the model, so only planning a layer at a time can complete
    row = bench.run(4096, 32, "meta", limit_gib=1.0)
    assert not row.get("out_of_memory"), "planning a layer at a time needed more than 1 GiB"
    assert row["model_gib"] == pytest.approx(2.0, rel=0.01)
    assert sum(row["balance"]) == 32
    assert bench.run(4096, 32, "whole", limit_gib=1.0) == {"out_of_memory": True}  # it bites
