"""The shared batch order: deterministic, resumable, batch sizes that add up."""

import torch

from giantpipe.data.batch_order import shuffled_batches


def test_two_batches_of_b_equal_one_of_2b():
    x, y = torch.arange(32.0).unsqueeze(1), torch.arange(32)
    small = shuffled_batches(x, y, 4, seed=5, position=0)
    big = next(shuffled_batches(x, y, 8, seed=5, position=0))
    assert torch.equal(torch.cat([next(small)[1], next(small)[1]]), big[1])
