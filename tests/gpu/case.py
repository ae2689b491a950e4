"""What makes a GPU test a case of the GPU check: its marks and the row it reports.

Every test here is marked ``gpu`` and carries a timeout that only a hang reaches (several times
what it should take; pytest-timeout's ``thread`` method: on expiry every thread's stack is
printed and the session ends, as a hung device leaves nothing else to run). Each reports one
row of the check's table through pytest's ``record_property`` (``check``, ``measured``,
``criterion``), which ``benchmarks/gpu_check.py`` turns into its report; what this machine
cannot judge is skipped with the reason as its verdict (``CUDA only``, ``needs 2 GPUs``).

Example::

    pytestmark = marks(60.0)

    def test_x(opts: GpuOptions, record_property: Record) -> None:
        ok, measured = fp32_verdict(got, ref)
        report(record_property, "gpipe / always", ok, measured, FP32_CRITERION)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import pytest

from giantpipe.testing.gpu import ceiling

Record = Callable[[str, object], None]
"""pytest's ``record_property`` fixture: ``record(name, value)`` on the test's report."""


def marks(gpu_seconds: float) -> list[pytest.MarkDecorator]:
    """A GPU test module's ``pytestmark``: ``gpu``, and the timeout of its tests (``ceiling``
    of :mod:`giantpipe.testing.gpu`: ``gpu_seconds`` on a GPU)."""
    return [pytest.mark.gpu, pytest.mark.timeout(ceiling(gpu_seconds), method="thread")]


def report(record: Record, check: str, ok: bool, measured: str, criterion: str) -> None:
    """Records the test's row, then fails the test unless ``ok``."""
    record("check", check)
    record("measured", measured)
    record("criterion", criterion)
    assert ok, f"{check}: {measured} (criterion: {criterion})"


def not_here(record: Record, why: str, check: str, measured: str, criterion: str) -> NoReturn:
    """Records the test's row and skips it: ``why`` is its verdict (``CUDA_ONLY`` or
    ``TWO_GPUS`` of :mod:`giantpipe.testing.gpu`)."""
    record("check", check)
    record("measured", measured)
    record("criterion", criterion)
    pytest.skip(why)
