"""The bring-your-own-model benchmark: its table from made-up results (failures listed, ratios
to the peer with the same schedule), and the quick run end to end (two gloo processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/sequentialize_cpu.py")


def test_table_lists_ratios_and_a_peers_wrong_gradient(bench: ModuleType) -> None:
    results = {
        "rounds": [{"gp-dist-gpipe": 1.0, "pippy-gpipe": 2.0}, {"gp-dist-gpipe": 1.2}],
        "first": {"gp-dist-gpipe": 6.0, "pippy-gpipe": 6.0},
        "tied": {"gp-dist-gpipe": 1e-7, "pippy-gpipe": 0.9},
        "reference": 6.0,
        "failures": {"pippy-1f1b": "build: ValueError: no"},
        "timed": [3, 1],
    }
    results["rounds"][0] |= {"gp-dist-gpipe-timed": 0.5, "pippy-gpipe-timed": 1.5}
    text = bench.table(bench.QUICK, results, ("1.00", "2.00"))
    assert "cut before transformer.h.1, -timed: before transformer.ln_f (balance_by_time)" in text
    assert "| gp-dist-gpipe | 116 | 1.100 | 1.82 | 1.82 | +0.0e+00 | 1.0e-07 |" in text
    assert "| gp-dist-gpipe-timed | 256 | 0.500 | 3.00 | 4.00 | - | - |" in text
    assert "- pippy-1f1b: build: ValueError: no" in text
    assert "- pippy-gpipe: the embedding gradient is 90% off the plain model's: each" in text
    assert "gp-dist-gpipe:" not in text.split("failures:")[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_compares_every_method(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = str(ROOT / "benchmarks" / "sequentialize_cpu.py")
    command = [sys.executable, script, "--quick", "--schedules", "gpipe"]  # 1f1b: the unit tests
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| gp-")]
    assert len(rows) == 4  # local and distributed, at the even cut and at giantpipe's own
    assert "| pippy-gpipe-timed |" in done.stdout
    for row in rows:
        assert row.split(" | ")[-1].strip(" |") != "-"  # the tied gradient was checked
        assert float(row.split(" | ")[-1].strip(" |")) < 1e-4, row  # and it is exact
