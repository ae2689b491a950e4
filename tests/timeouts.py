"""The suite's timeouts, one knob for all: ``GIANTPIPE_TEST_TIMEOUT_SCALE`` (a factor, default 1)
lengthens every fixed timeout of the tests (a subprocess's, a rank's, a pipeline's), and a test
that runs out of time says so, naming the timeout and the knob (tests/conftest.py adds the same
words to any failure that reads as a timeout).

Example::

    GIANTPIPE_TEST_TIMEOUT_SCALE=3 python -m pytest -m "not slow"     # a machine three times busier

    pipe = DistributedPipe(model_fn, balance, timeout=scaled(20))
    done = run([sys.executable, "train.py", ...], timeout=120, capture_output=True, text=True)
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

KNOB = "GIANTPIPE_TEST_TIMEOUT_SCALE"


def scale() -> float:
    """The factor the knob sets (1 when unset); anything but a positive number is refused."""
    given = os.environ.get(KNOB, "1")
    try:
        factor = float(given)
    except ValueError:
        factor = 0.0
    if not factor > 0:
        raise ValueError(f"{KNOB}={given!r}: give a positive factor, e.g. {KNOB}=3")
    return factor


def scaled(seconds: float) -> float:
    """``seconds`` times the knob's factor."""
    return seconds * scale()


def timed_out(what: str, seconds: float) -> str:
    """The words of a timeout: which one, how long, and the knob that lengthens it."""
    return (
        f"timeout: {what} ran out of its {seconds:g} s; on a busy machine set "
        f"{KNOB} (now {scale():g}) to lengthen every test timeout, e.g. {KNOB}=3"
    )


def busy_hint() -> str:
    """What a failure that reads as a timeout (:data:`TIMEOUT_WORDS`) adds to its report."""
    return (
        f"this failure reads as a timeout: on a busy machine set {KNOB} (now {scale():g}) to "
        f"lengthen every test timeout, e.g. {KNOB}=3"
    )


TIMEOUT_WORDS = re.compile(r"timed? ?out|TimeoutExpired|PipelineTimeout|waited [\d.]+ ?s", re.I)
"""What the failures of a timeout say: subprocess's, torch.distributed's, the engine's."""


def run(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` under ``scaled(timeout)``; running out of it fails with
    :func:`timed_out`'s words."""
    limit = scaled(timeout)
    try:
        return subprocess.run(command, timeout=limit, **kwargs)
    except subprocess.TimeoutExpired:
        name = " ".join(str(c) for c in command[:3])
        raise AssertionError(timed_out(name, limit)) from None
