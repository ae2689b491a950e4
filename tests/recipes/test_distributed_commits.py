"""benchmarks/distributed_commits.py --quick: two revisions' distributed pipes and pippy's in the
same processes, end to end (here HEAD against itself); the base's worktree is gone afterwards."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from giantpipe.engine.schedules import schedule_builders
from tests.support.scripts import load_script
from tests.support.worktrees import worktrees_under

REPO = Path(__file__).resolve().parents[2]
RATIO = re.compile(r"\| (\d+) \| ([\w /-]+?) \| ([\d.]+) \| ([\d., ]+) \|")


@pytest.mark.slow
def test_quick_comparison_times_both_revisions_and_pippy_side_by_side(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    inside = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if inside.returncode != 0:
        pytest.skip("needs a git checkout")
    command = [sys.executable, str(REPO / "benchmarks" / "distributed_commits.py")]
    done = subprocess.run(
        [*command, "--base", "HEAD", "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, TMPDIR=str(tmp_path)),  # its worktree goes under tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("| M | base-"))
    methods = {cell.strip() for cell in header.strip("|").split("|")[1:]}
    for name in schedule_builders():  # every schedule at both revisions, timed alike
        assert {f"base-{name}", f"head-{name}"} <= methods, name
    assert {"pippy-gpipe", "pippy-1f1b"} <= methods
    ratios = {(int(m), name): float(value) for m, name, value, _ in RATIO.findall(done.stdout)}
    for m in (1, 4):
        for name in ("head / base gpipe", "base best / pippy best", "head best / pippy best"):
            assert ratios[(m, name)] > 0, (m, name)
    assert worktrees_under(tmp_path) == []  # the base's temporary worktree is gone


def test_its_model_choices_are_the_distributed_benchmarks_models() -> None:
    """distributed_commits.py names the models in a torch-free literal (its --help answers before
    torch loads); the models it runs are distributed_cpu.py's."""
    sys.path.insert(0, str(REPO / "benchmarks"))  # distributed_commits imports its neighbours
    try:
        commits = load_script("benchmarks/distributed_commits.py")
        cpu = load_script("benchmarks/distributed_cpu.py")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert set(commits.MODELS) == set(cpu.FULL) == set(cpu.QUICK)
