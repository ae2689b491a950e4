"""docs/architecture.md's module map names every module of src/giantpipe (issue 31): a module
added, moved or removed without the map fails here. A package's ``__init__`` may stay out of
the map (its own docstring lists its modules) unless it holds code of its own."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "giantpipe"


def test_the_module_map_names_every_module_and_nothing_else():
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Module map", 1)[1]
    mapped = set(re.findall(r"^- `([\w/]+\.py)`:", text, re.M))
    modules = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}
    assert sorted(m for m in modules - mapped if not m.endswith("__init__.py")) == []
    assert sorted(mapped - modules) == []
