"""A boundary value that is not contiguous travels with its values, not its memory (issue 40).

A frame copies each tensor into the message; a tensor whose memory is not its values in order
(transposed, sliced, channels-last) must be copied by its values. The same property through a
real step between ranks: tests/unit/engine/distributed/k2_r2_workers.py (check 7).
"""

from __future__ import annotations

import pytest
import torch

from giantpipe.engine.distributed.wire import Frame, encode, pack, unpack


def strided_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 10, generator=g)
    return {
        "transposed": torch.randn(5, 3, generator=g).t(),
        "columns": wide[:, 2:7],
        "every other row": wide[::2],
        "permuted": torch.randn(2, 3, 4, 5, generator=g).permute(0, 2, 3, 1),
        "channels last": torch.randn(2, 3, 4, 4, generator=g).to(memory_format=torch.channels_last),
        "int64 transposed": torch.arange(12).reshape(3, 4).t(),
    }


@pytest.mark.parametrize("name", list(strided_values()))
def test_a_tensor_that_is_not_contiguous_arrives_with_its_values(name: str) -> None:
    value = strided_values()[name]
    assert not value.is_contiguous()
    words, tensors = encode(value)
    frame = Frame.of(words)
    got = unpack(frame, pack(frame, tensors, seed=3, key=("act", 1, 0)))
    assert got.shape == value.shape and got.dtype == value.dtype
    assert torch.equal(got, value)


def test_a_tuple_of_strided_and_contiguous_tensors_arrives_with_every_value() -> None:
    value = (*strided_values().values(), torch.ones(3), None, 2)
    words, tensors = encode(value)
    frame = Frame.of(words)
    got = unpack(frame, pack(frame, tensors, seed=3, key=("grad", 0, 1)))
    for sent, received in zip(value, got, strict=True):
        if isinstance(sent, torch.Tensor):
            assert torch.equal(received, sent)
        else:
            assert received == sent
