"""DataBundle.first_batch: the sample capture, sizing and planning take, read once, its
iterator closed at once (a DataLoader's workers shut down before later loaders fork theirs)."""

from collections.abc import Iterator

import torch

from giantpipe.data.bundle import Batch, DataBundle


def test_the_first_batch_is_read_once_and_its_iterator_closed() -> None:
    opened: list[int] = []
    closed: list[int] = []

    def train_batches(seed: int, position: int) -> Iterator[Batch]:
        opened.append(seed)
        try:
            step = position
            while True:
                yield torch.full((2,), float(seed + step)), torch.zeros(2)
                step += 1
        finally:
            closed.append(seed)

    bundle = DataBundle(train_batches=train_batches, eval_batches=list, batches_per_epoch=1)
    first = bundle.first_batch(3)
    assert closed == [3]  # closed before first_batch returned, not left to the collector
    assert bundle.first_batch(3) is first and opened == [3]  # read once
    assert torch.equal(first[0], torch.full((2,), 3.0))
    assert torch.equal(bundle.first_batch(5)[0], torch.full((2,), 5.0)) and closed == [3, 5]
