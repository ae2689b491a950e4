"""Module heads stay short: every module of src/giantpipe and models/ opens with a docstring
whose first line says what it is, then at most a short paragraph and one example, MAX_LINES
lines in all (what ``structure.py`` flags). Design notes go to a docs/ section the head links
to, and every link from a module to docs/ must lead to a heading that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "giantpipe"
MAX_LINES = 15
DOCS_LINK = re.compile(r"docs/([\w\-]+\.md)(?:#([\w\-]+))?")


def modules() -> list[Path]:
    """Every module of src/giantpipe and of the models package."""
    return sorted([*SRC.rglob("*.py"), *(ROOT / "models").rglob("*.py")])


def heads() -> dict[str, str | None]:
    """Each module (relative to the repository) and its docstring, as written."""
    return {
        path.relative_to(ROOT).as_posix(): ast.get_docstring(
            ast.parse(path.read_text()), clean=False
        )
        for path in modules()
    }


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings (as tests/integration/test_docs.py)."""
    titles = re.findall(r"^#+ (.*)$", doc.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


def test_every_module_says_first_what_it_is() -> None:
    silent = [m for m, doc in heads().items() if not doc or not doc.splitlines()[0].strip()]
    assert silent == [], f"no docstring, or one that does not open with what it is: {silent}"


def test_module_heads_are_short() -> None:
    lengths = {m: len(doc.splitlines()) for m, doc in heads().items() if doc}
    long = sorted(f"{m} ({n} lines)" for m, n in lengths.items() if n > MAX_LINES)
    assert long == [], (
        f"module heads over {MAX_LINES} lines: move the design notes to a docs/ section "
        f"and link it: {long}"
    )


def test_links_from_src_to_docs_lead_somewhere() -> None:
    """A link in a module (its head, a function's docstring, a comment) names a doc and a
    heading that exist."""
    broken = []
    for path in modules():
        module = path.relative_to(ROOT).as_posix()
        for file, anchor in DOCS_LINK.findall(path.read_text()):
            target = ROOT / "docs" / file
            if not target.exists() or (anchor and anchor not in anchors(target)):
                broken.append(f"{module}: docs/{file}{'#' + anchor if anchor else ''}")
    assert broken == [], f"links to no such doc or heading: {broken}"
