"""docs/architecture.md's module map names every module of src/giantpipe, once, and nothing
else: a module added, moved or removed without the map fails here. A package's ``__init__``
may stay out of the map (its own docstring says what its modules are) unless it holds code of
its own: a function or a class (a lazy ``__getattr__`` included)."""

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "giantpipe"


def mapped_entries() -> list[str]:
    """The module of each line of the map, in order (``- `path.py`: what it holds``)."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Module map", 1)[1]
    return re.findall(r"^- `([\w/]+\.py)`:", text, re.M)


def holds_code(path: Path) -> bool:
    """Whether a module defines a function or a class at its top level."""
    body = ast.parse(path.read_text()).body
    return any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in body)


def test_the_module_map_names_every_module_and_nothing_else() -> None:
    mapped = set(mapped_entries())
    paths = {p.relative_to(SRC).as_posix(): p for p in SRC.rglob("*.py")}
    needed = {m for m, p in paths.items() if not m.endswith("__init__.py") or holds_code(p)}
    assert sorted(needed - mapped) == [], "modules missing from docs/architecture.md's map"
    assert sorted(mapped - set(paths)) == [], "map entries naming no module"


def test_the_module_map_names_each_module_once() -> None:
    twice = sorted(m for m, n in Counter(mapped_entries()).items() if n > 1)
    assert twice == []
