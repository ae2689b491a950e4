"""The planner's command line (recipes/plan_pipeline.py) and the full-size models it builds by
name (recipes/model_sizes.py)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def recipe() -> ModuleType:
    return load_script("recipes/plan_pipeline.py")


def test_model_builders_count_the_papers_parameters(recipe: ModuleType) -> None:
    model, sample = recipe.build("transformer-l", layers=3)
    assert sum(p.numel() for p in model.parameters()) == 282_146_816
    model, sample = recipe.build("amoebanet-d", layers=18, filters=208)
    assert sum(p.numel() for p in model.parameters()) == 81_505_540
    assert sample.shape == (1, 3, 224, 224)
    with pytest.raises(ValueError, match="unknown model"):
        recipe.build("resnet")


def test_cli_prints_a_table(recipe: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    code = recipe.main(
        [
            "--model",
            "amoebanet-d",
            "--layers",
            "3",
            "--filters",
            "16",
            "--image-size",
            "64",
            "--devices",
            "2",
            "--memory-gib",
            "1",
            "--batch",
            "8",
            "--top",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "| # | schedule | V | M | recompute | balance | samples/s" in out
    assert len([line for line in out.splitlines() if line.startswith("| 3 |")]) == 1
