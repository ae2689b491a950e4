"""benchmarks/checkpoint_save.py --quick: both save modes side by side, the hash cost and the
storage comparison, end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_prints_both_modes_the_ratio_and_the_storage_table(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_save.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
            "PATH": "/usr/bin:/bin",
            "TMPDIR": str(tmp_path),
        },
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if "|" in line}
    for mode in ("sync", "async", "dcp", "torch.save"):
        cells = [float(c) for c in rows[mode].strip("|").split("|")[1:]]
        assert all(c >= 0 for c in cells) and cells[0] > 0, rows[mode]
    (ratio,) = [line for line in done.stdout.splitlines() if line.startswith("blocked, async")]
    assert float(ratio.rsplit(" ", 1)[1]) > 0
    assert "sha256 as a save writes" in done.stdout and "checking a save" in done.stdout
    assert not list(tmp_path.glob("giantpipe-ckpt-bench-*"))  # its checkpoints are gone
