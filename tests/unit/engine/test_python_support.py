"""Issue 22, "Also": the engine names a failing stage with an exception note
(``BaseException.add_note``, Python 3.11+; on 3.10 it would surface as AttributeError and no
traceback would show the note), so the project allows no Python older than 3.11."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_python_allowed_has_exception_notes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    spec = project["project"]["requires-python"]
    oldest = re.fullmatch(r">=\s*3\.(\d+)", spec)
    assert oldest is not None and int(oldest.group(1)) >= 11, spec
    assert project["tool"]["ruff"]["target-version"] == f"py3{oldest.group(1)}"
    assert f"Python 3.{oldest.group(1)}+" in (ROOT / "README.md").read_text()
