"""Values that crossed a transport compared with what was sent: dtype, shape and bits of each
tensor, and the plain items of a tuple by value and type.

Example::

    assert_same((torch.ones(2), 3), received)
"""

from __future__ import annotations

from typing import Any

import torch


def assert_same(sent: Any, got: Any) -> None:
    """``got`` is ``sent`` as it left: equal tensors of the same dtype and shape, equal items."""
    if isinstance(sent, torch.Tensor):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
        return
    assert isinstance(got, tuple) and len(got) == len(sent)
    for a, b in zip(sent, got):
        if isinstance(a, torch.Tensor):
            assert_same(a, b)
        else:
            assert a == b and type(a) is type(b)
