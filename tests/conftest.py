"""Shared test settings: small thread pools so the suite behaves on a 2-core machine, and the
lanes: every test under tests/distributed/ (several processes) and tests/recipes/ (a benchmark's
or a recipe's quick run) is ``slow``, so ``pytest -m "not slow"`` is the everyday lane."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HYDRA_FULL_ERROR", "0")


SLOW_DIRS = ("distributed", "recipes")
"""Folders of tests/ whose every test is slow (marked here, so a new file there is too)."""


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(tests) and path.relative_to(tests).parts[0] in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)
