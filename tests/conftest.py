"""Shared test settings: small thread pools so the suite behaves on a 2-core machine, the lanes,
how xdist spreads the suite over the cores, and what a failure that reads as a timeout says
(the knob that lengthens every timeout: tests/timeouts.py).

Lanes: every test under tests/distributed/ (several processes) and tests/recipes/ (a benchmark's
or a recipe's quick run) is ``slow``, so ``pytest -m "not slow"`` is the everyday lane.

Spreading (``-n auto --dist loadfile`` in pyproject.toml): a file's tests run on one worker, in
order, sharing its module fixtures, except the tests of a function named in :data:`SPREAD`, each
of which goes to whichever worker is free (:func:`unit_of`), so one long file of independent
end-to-end tests (every docs block, every CNN) spreads over the workers. The units holding slow
tests are handed out first: the many short files then fill the workers' last minutes, where one
long file handed out last would leave the other worker idle.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import pytest

from tests.timeouts import KNOB, TIMEOUT_WORDS, busy_hint, scale

pytest_plugins = ["tests.cpu_report"]  # --cpu-report=N: the tests that cost the most CPU

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HYDRA_FULL_ERROR", "0")


SLOW_DIRS = ("distributed", "recipes")
"""Folders of tests/ whose every test is slow (marked here, so a new file there is too)."""

SPREAD = (
    "tests/integration/test_docs.py::test_block_runs_as_printed",
    "tests/unit/engine/test_capture_cnns.py::test_cnn_default_cut_pipelined_equals_the_original",
)
"""Test functions whose parametrized tests are independent and long: each its own unit of work.
(xdist's ``xdist_group`` mark cannot say it: xdist reads groups from node ids, and the node ids
of this pytest version do not carry them; the scheduler sees node ids only.)"""


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(tests) and path.relative_to(tests).parts[0] in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)
    items[:] = slow_units_first(items)


def unit_of(nodeid: str) -> str:
    """What one worker runs in one go: the test alone if its function is in :data:`SPREAD`,
    else its whole file.

    Example::

        unit_of("tests/unit/engine/test_spec.py::test_x")     # "tests/unit/engine/test_spec.py"
        unit_of("tests/integration/test_docs.py::test_block_runs_as_printed[README.md:40]")
        # the node id itself
    """
    if nodeid.split("[", 1)[0] in SPREAD:
        return nodeid
    return nodeid.split("::", 1)[0]


def slow_units_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the units (:func:`unit_of`) that hold a slow test first, each unit's tests
    in their order: xdist hands the units out in the order it first sees them
    (``--no-loadscope-reorder``).

    Example::

        slow_units_first([fast_a, slow_b, fast_b2])   # [slow_b, fast_b2, fast_a] (b: one file)
    """
    slow = {unit_of(item.nodeid) for item in items if item.get_closest_marker("slow")}
    return sorted(items, key=lambda item: unit_of(item.nodeid) not in slow)  # a stable sort


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own; absent without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` as this suite means it: by file, but the tests of a :data:`SPREAD`
    function each alone (:func:`unit_of`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileOrAlone(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return FileOrAlone(config, log)  # type: ignore[arg-type]


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads its settings
def pytest_configure(config: pytest.Config) -> None:
    """pytest-timeout's limit (pyproject.toml's ``timeout``) lengthened by the knob too, unless
    ``--timeout`` or PYTEST_TIMEOUT gives one."""
    try:
        given = config.getvalue("timeout")
    except ValueError:  # pytest-timeout is not installed
        return
    ini = config.getini("timeout")
    if given is None and "PYTEST_TIMEOUT" not in os.environ and ini:
        config.option.timeout = float(ini) * scale()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failure that reads as a timeout (tests/timeouts.py) says how to lengthen the suite's
    timeouts, unless it already names the knob."""
    report = yield
    if report.failed and call.excinfo is not None:
        said = f"{call.excinfo.typename}: {call.excinfo.value}"
        longrepr = report.longrepr
        if TIMEOUT_WORDS.search(said) and KNOB not in said and hasattr(longrepr, "addsection"):
            longrepr.addsection("timeout", busy_hint())
    return report
