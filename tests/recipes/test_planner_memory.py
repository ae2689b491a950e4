"""benchmarks/planner_memory.py --quick: planning a model built on meta holds a layer at a time,
not the model (a fresh process's peak resident memory, against the model's fp32 bytes)."""

from __future__ import annotations

import pytest

from tests.recipes.scripts import load_script


def test_planning_a_model_on_meta_holds_far_less_than_the_model() -> None:
    bench = load_script("benchmarks/planner_memory.py")
    row = bench.run(4096, 16, "meta")  # 16 layers of 64 MiB: 1 GiB
    assert row["model_gib"] == pytest.approx(1.0, rel=0.01)
    # a layer (its copy, gradient and the copies a profile makes) and the interpreter's own
    # growth: the whole model alone would be 1 GiB
    assert row["peak_gib"] < 0.5, row
    assert sum(row["balance"]) == 16
