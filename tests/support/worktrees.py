"""The repository's git worktrees under one folder (what a benchmark left behind).

A benchmark that checks a base revision out runs with ``TMPDIR`` set to a test's own folder;
only worktrees under that folder are its own, whatever other tests or people add meanwhile.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worktrees_under(folder: Path) -> list[str]:
    """Paths of the worktrees git still lists under ``folder`` (a removed folder whose worktree
    was never removed is still listed, as prunable)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list", "--porcelain"],
        capture_output=True,
        text=True,
        check=True,
    )
    inside = str(folder.resolve())
    paths = [line[len("worktree ") :] for line in listed.stdout.splitlines()
             if line.startswith("worktree ")]  # fmt: skip
    return [p for p in paths if p == inside or p.startswith(inside + "/")]
