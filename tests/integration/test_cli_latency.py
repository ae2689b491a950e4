"""benchmarks/cli_latency.py --quick: one timed run of each case, its table printed."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark's quick run: six short processes
def test_quick_run_prints_a_row_per_case():
    script = REPO / "benchmarks" / "cli_latency.py"
    result = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| bad override",
        "| bad value",
        "| bad model value",
        "| --help",
        "| generate: bad argument",
        "| generate: no run",
    ]
