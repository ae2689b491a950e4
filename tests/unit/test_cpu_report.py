"""tests/cpu_report.py: --cpu-report counts a test's own CPU and its children's, under xdist too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BURNING = """
import subprocess, sys, time

SPIN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass"

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", SPIN], check=True)

def test_sleeps():
    time.sleep(1.0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_childs_cpu_is_its_tests_and_sleep_is_not(tmp_path: Path, workers: str) -> None:
    (tmp_path / "test_burn.py").write_text(BURNING)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.cpu_report",
            "--cpu-report=5",
            "-n",
            workers,
            "-p",
            "no:cacheprovider",
            "-q",
            "test_burn.py",
        ],  # fmt: skip
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = done.stdout.split("tests using the most CPU", 1)[1]
    rows = re.findall(r"^\s*([\d.]+)\s+([\d.]+)\s+test_burn\.py::(\w+)$", table, re.M)
    assert [name for _, _, name in rows] == ["test_burns_in_a_child", "test_sleeps"], table
    (burn_cpu, _, _), (sleep_cpu, sleep_wall, _) = rows
    assert float(burn_cpu) >= 0.9  # the child's second is the test's
    assert float(sleep_cpu) < 0.5 <= float(sleep_wall)  # a sleep is wall time, not CPU
