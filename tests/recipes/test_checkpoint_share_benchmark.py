"""benchmarks/checkpoint_share.py --quick: every rank's share read and equal to a whole load,
and every export's peak, end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_the_load_and_export_tables(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_share.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={
            "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
            "PATH": "/usr/bin:/bin",
            "TMPDIR": str(tmp_path),
        },
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [
        line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("| ")
    ]
    ranks = [r for r in rows if r[0].strip() in ("hf", "ckpt") and r[1].strip().isdigit()]
    assert len(ranks) == 8 and all(r[-1].strip() == "True" for r in ranks)  # 4 ranks, 2 sources
    exports = [
        r for r in rows if r[0].strip() in ("pt", "safetensors", "safetensors shards", "whole")
    ]
    assert len(exports) == 8 and all(float(r[3]) >= 0 for r in exports)
    assert (tmp_path / "outputs" / "checkpoints" / "share.md").read_text().startswith("`python")
    assert not list(tmp_path.glob("giantpipe-share-bench-*"))  # its files are gone
