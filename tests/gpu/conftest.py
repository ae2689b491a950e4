"""The GPU tests' run: the ``opts`` fixture (CUDA devices, or CPU stand-ins), skipped without
either, and the rows ``benchmarks/gpu_check.py`` collects.

``python -m pytest -m gpu`` on a GPU machine runs every test here on its GPUs; on a machine
without one each test skips ("needs CUDA"), unless ``GIANTPIPE_GPU_STANDINS=1`` asks for CPU
stand-ins at tiny sizes (what ``python benchmarks/gpu_check.py --cpu-dry-run`` runs). With
``GIANTPIPE_GPU_ROWS=FILE`` each test's start, then its outcome and recorded row, are appended
to FILE, one JSON object a line (written as they happen: a later hang keeps the rows before
it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from giantpipe.testing.gpu import ROWS, GpuOptions


@pytest.fixture(scope="session")
def opts() -> GpuOptions:
    """This run's devices: the GPUs, or CPU stand-ins; skips the test where there are none."""
    found = GpuOptions.from_env()
    if not found.dry and found.gpus == 0:
        pytest.skip("needs CUDA (GIANTPIPE_GPU_STANDINS=1 runs it on CPU stand-ins)")
    if found.dry:  # OpenMP threads spinning on shared cores make tiny CPU steps 10-60x slower
        torch.set_num_threads(1)
    return found


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Appends the test's start and its timeout to ``$GIANTPIPE_GPU_ROWS`` (a test that hangs
    ends the session: this line says which one, and after how long)."""
    path = os.environ.get(ROWS)
    mark = item.get_closest_marker("timeout")
    if path:
        started = {
            "nodeid": item.nodeid,
            "started": True,
            "timeout": mark.args[0] if mark else None,
            "time": time.time(),  # where a case sharing its pytest with others begins
        }
        _append(Path(path), started)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Appends the test's outcome to ``$GIANTPIPE_GPU_ROWS``: its call, or the setup or
    teardown that decided it."""
    path = os.environ.get(ROWS)
    deciding = report.when == "call" or (report.when != "call" and not report.passed)
    if not path or not deciding:
        return
    row = {
        "nodeid": report.nodeid,
        "outcome": report.outcome,
        "when": report.when,
        "properties": [(name, str(value)) for name, value in report.user_properties],
        "reason": _reason(report),
        "log": report.longreprtext if report.failed else "",
    }
    _append(Path(path), row)


def _append(path: Path, row: dict[str, object]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _reason(report: pytest.TestReport) -> str:
    """Why a test skipped ("CUDA only"), or the exception it failed with."""
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple):
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    return crash.message.splitlines()[0] if crash is not None and crash.message else ""
