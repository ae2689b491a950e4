"""Micro-batching: exact split sizes, tuples with int/bool tensors, clear errors."""

import pytest
import torch

from giantpipe.engine.microbatch import batch_size, forward_chunks, gather, scatter, split_sizes
from giantpipe.engine.spec import SpecError


@pytest.mark.parametrize(
    ("total", "chunks", "sizes"),
    [(8, 1, [8]), (8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (7, 7, [1] * 7), (5, 2, [3, 2]),
     (0, 1, [0])],
)  # fmt: skip
def test_split_sizes(total: int, chunks: int, sizes: list[int]) -> None:
    assert split_sizes(total, chunks) == sizes


def test_more_chunks_than_samples_is_an_error_naming_the_key() -> None:
    message = r"pipeline\.chunks: chunks \(5\) is larger than the batch size \(4\)"
    with pytest.raises(SpecError, match=message):
        scatter(torch.zeros(4, 2), 5)
    with pytest.raises(ValueError, match=r"chunks \(2\) is larger than the batch size \(0\)"):
        split_sizes(0, 2)


@pytest.mark.parametrize(
    ("total", "chunks", "count"),
    [(32, 4, 4), (5, 4, 4), (4, 4, 4), (3, 4, 3), (1, 4, 1), (0, 4, 1), (1, 1, 1), (7, 32, 7)],
)
def test_a_forward_without_gradients_runs_fewer_micro_batches(
    total: int, chunks: int, count: int
) -> None:
    assert forward_chunks(total, chunks) == count
    parts = scatter(torch.arange(total), count)
    assert [len(p) for p in parts] == split_sizes(total, count) and len(parts) == count


def test_scatter_gather_tuple_with_masks() -> None:
    x = torch.randn(10, 3, requires_grad=True)
    mask = torch.arange(10) % 2 == 0
    ids = torch.arange(10)
    parts = scatter((x, mask, ids, None), 4)
    assert [p[0].shape[0] for p in parts] == [3, 3, 2, 2]
    assert parts[1][1].dtype == torch.bool and parts[1][3] is None
    assert not parts[0][2].requires_grad
    back = gather(parts)
    assert torch.equal(back[0], x) and torch.equal(back[1], mask) and torch.equal(back[2], ids)


def test_batch_size_errors() -> None:
    with pytest.raises(ValueError, match="disagree"):
        batch_size((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(TypeError, match="at least one tensor"):
        batch_size((None, 3))
