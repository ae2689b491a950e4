"""benchmarks/commits.py --quick: two revisions side by side, end to end (here HEAD and itself)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.worktrees import worktrees_under

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_comparison_prints_both_measurements(tmp_path: Path) -> None:
    inside = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True)
    if shutil.which("git") is None or inside.returncode != 0:
        pytest.skip("needs a git checkout")
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "commits.py"), "--base", "HEAD", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, TMPDIR=str(tmp_path)),  # its worktree goes under tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| local")]
    rows += [line for line in done.stdout.splitlines() if line.startswith("| distributed")]
    assert len(rows) == 2
    for row in rows:
        base, head, ratio = (float(cell) for cell in row.strip("|").split("|")[2:5])
        assert base > 0 and head > 0 and ratio > 0
    assert worktrees_under(tmp_path) == []  # the base's temporary worktree is gone
