"""The integration tests' shared fixtures: one finished tiny run per worker, copied per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.fault_runs import copy_of, finish


@pytest.fixture(scope="session")
def finished_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny run of ``fault_runs.FINISHED``, trained once (the fault tests damage copies)."""
    return finish(tmp_path_factory.mktemp("finished") / "run")


@pytest.fixture
def finished_run(finished_once: Path, tmp_path: Path) -> Path:
    """This test's copy of the finished run, at ``tmp_path/run``."""
    return copy_of(finished_once, tmp_path)
