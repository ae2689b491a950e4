"""How xdist spreads the suite (tests/conftest.py): a file is one unit of work, the tests of a
SPREAD function each their own, and the units holding slow tests go first."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import SPREAD, slow_units_first, unit_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", SPREAD)
def test_every_spread_function_exists(name: str) -> None:
    """A renamed function would quietly go back to running its whole file on one worker."""
    path, _, function = name.partition("::")
    assert f"\ndef {function}(" in (ROOT / path).read_text(), name


def test_a_file_is_one_unit_and_a_spread_test_its_own() -> None:
    docs = "tests/integration/test_docs.py"
    assert unit_of(f"{docs}::test_links_lead_somewhere[README.md]") == docs
    block = f"{docs}::test_block_runs_as_printed[docs/engine.md:12]"
    assert unit_of(block) == block
    assert unit_of("src/giantpipe/cli/checks.py::giantpipe.cli.checks.renamed") == (
        "src/giantpipe/cli/checks.py"
    )


@dataclass
class Item:
    """What slow_units_first reads of a pytest item."""

    nodeid: str
    marks: list[str] = field(default_factory=list)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.marks else None


def test_the_units_holding_slow_tests_go_first_each_in_its_order() -> None:
    items = [
        Item("tests/unit/a.py::one"),
        Item("tests/unit/b.py::fast"),
        Item("tests/unit/b.py::slow", ["slow"]),
        Item("tests/unit/c.py::slow", ["slow"]),
    ]
    ordered = [i.nodeid for i in slow_units_first(items)]  # type: ignore[arg-type]
    assert ordered == [
        "tests/unit/b.py::fast",
        "tests/unit/b.py::slow",
        "tests/unit/c.py::slow",
        "tests/unit/a.py::one",
    ]
