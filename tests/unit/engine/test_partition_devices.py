"""Every CUDA device carries its index (issue 21, item 7): ``torch.device("cuda")`` differs
from ``torch.device("cuda:0")``, and the current device it would mean is thread-local, so an
index-less device is fixed to the caller's current one when the pipe is built. The current
device is injected: no GPU needed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from giantpipe.engine.partition import resolve_devices, with_index

CPU = torch.device("cpu")
GPU0, GPU1 = torch.device("cuda:0"), torch.device("cuda:1")


def never() -> int:
    raise AssertionError("the current device was asked for a device that names its own")


@pytest.mark.parametrize(
    ("given", "current", "expected"),
    [
        (["cuda", "cuda"], 0, [GPU0, GPU0]),
        (["cuda", "cuda:0"], 0, [GPU0, GPU0]),  # one device, not two
        (["cuda", 0], 1, [GPU1, GPU0]),
        ([torch.device("cuda"), "cpu"], 1, [GPU1, CPU]),
    ],
)
def test_an_index_less_cuda_device_is_the_current_one(
    given: list[Any], current: int, expected: list[torch.device]
) -> None:
    resolved = resolve_devices(given, len(given), current=lambda: current)
    assert resolved == expected
    assert all(d.index is not None for d in resolved if d.type == "cuda")


def test_devices_with_an_index_do_not_ask_for_the_current_one() -> None:
    assert resolve_devices(["cuda:1", 0, "cpu"], 3, current=never) == [GPU1, GPU0, CPU]
    assert with_index(torch.device("cuda", 3), never) == torch.device("cuda:3")
    assert with_index(CPU, never) == CPU
