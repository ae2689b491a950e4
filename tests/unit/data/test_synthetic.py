"""Generated classification data (``data=synthetic``): deterministic, resumable batches; train
and eval share the teacher."""

import torch

from giantpipe.data.synthetic import classification


def test_batches_are_a_function_of_seed_and_position():
    bundle = classification(features=4, classes=3, train_size=40, eval_size=8, batch_size=8)
    assert bundle.batches_per_epoch == 5
    full = [next(s) for s in [bundle.train_batches(0, 0)] for _ in range(12)]
    resumed = bundle.train_batches(0, 7)
    for expected in full[7:]:
        got = next(resumed)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    other_seed = next(bundle.train_batches(1, 0))
    assert not torch.equal(other_seed[0], full[0][0])


def test_train_and_eval_share_the_teacher():
    bundle = classification(features=4, classes=3, train_size=64, eval_size=64, batch_size=64)
    (tx, ty), (ex, ey) = next(bundle.train_batches(0, 0)), bundle.eval_batches()[0]
    assert not torch.equal(tx, ex)
    # A nearest-neighbour guess from train to eval beats chance only if the labels agree.
    nearest = torch.cdist(ex, tx).argmin(dim=1)
    assert (ty[nearest] == ey).float().mean() > 0.5
