"""Where the suite's CPU goes: ``--cpu-report=N`` lists the N tests that used the most CPU seconds,
their own and that of every process they started and waited for (torchrun's ranks included).

The suite is CPU-bound on CI's two cores, so CPU, not wall time, says what a test costs: a test's
wall time also holds the other worker's load. Works under xdist (each worker measures its tests;
the figures travel to the controller in the reports).

Example::

    python -m pytest --cpu-report=30          # the 30 costliest tests, beside their wall time
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

from tests.support.forks import forked_cpu

CPU_KEY = "cpu_seconds"
_SPENT = pytest.StashKey[float]()


def cpu_seconds() -> float:
    """This process' CPU seconds so far, its own, its waited-for children's and those its fork
    server forked for it (ranks, ``train.py`` runs: tests/support/forks.py)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + forked_cpu()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-report",
        type=int,
        default=0,
        metavar="N",
        help="list the N tests that used the most CPU (theirs and their waited-for processes')",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Measures setup, call and teardown together (a fixture's run belongs to its first test),
    only when asked: reading the fork server's figures from /proc costs every test."""
    if item.config.getoption("cpu_report"):
        item.stash[_SPENT] = -cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "teardown" and _SPENT in item.stash:
        report.user_properties.append((CPU_KEY, item.stash[_SPENT] + cpu_seconds()))
    return report


class CpuTable:
    """The controller's collector: each test's CPU and wall seconds, printed at the end."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.wall[report.nodeid] = self.wall.get(report.nodeid, 0.0) + report.duration
        for key, value in report.user_properties:
            if key == CPU_KEY:
                self.cpu[report.nodeid] = float(value)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        write = terminalreporter.write_line
        terminalreporter.section(f"{self.count} tests using the most CPU")
        write(f"{'CPU s':>8} {'wall s':>8}  test (CPU of all {len(self.cpu)}: "
              f"{sum(self.cpu.values()):.0f} s)")  # fmt: skip
        for nodeid, cpu in sorted(self.cpu.items(), key=lambda kv: -kv[1])[: self.count]:
            write(f"{cpu:8.1f} {self.wall.get(nodeid, 0.0):8.1f}  {nodeid}")


def pytest_configure(config: pytest.Config) -> None:
    count = config.getoption("cpu_report")
    if count and not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(CpuTable(count), "cpu-table")
