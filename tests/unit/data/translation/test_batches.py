"""Translation batches: temperature sampling over pairs, token-bounded batches, resumable state,
evaluation batches that keep every example."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from giantpipe.data.translation.batches import (
    MultilingualBatches,
    eval_batches,
    temperature_probabilities,
    token_batches,
)


def test_temperature_probabilities_follow_the_formula() -> None:
    sizes = {"a": 9000, "b": 900, "c": 100}
    for temperature in (1.0, 2.0, 5.0):
        probs = temperature_probabilities(sizes, temperature)
        weights = {k: (n / 10000) ** (1 / temperature) for k, n in sizes.items()}
        for key in sizes:
            assert probs[key] == pytest.approx(weights[key] / sum(weights.values()), rel=1e-12)
    assert temperature_probabilities(sizes, 1.0)["c"] == pytest.approx(0.01)
    assert max(temperature_probabilities(sizes, 1e6).values()) == pytest.approx(1 / 3, rel=1e-4)
    with pytest.raises(ValueError):
        temperature_probabilities(sizes, 0.0)


def test_sampled_pairs_match_the_probabilities(encoded) -> None:
    batches = MultilingualBatches(encoded, max_tokens=4096, temperature=5.0, seed=3)
    draws = 4000
    counts: dict[str, int] = {}
    for step in range(draws):  # the pair of step s depends only on (seed, s)
        batches.step = step
        pair = batches.next_pair()
        counts[pair] = counts.get(pair, 0) + 1
    expected = temperature_probabilities({p: len(encoded[p]) for p in encoded}, 5.0)
    for pair, p in expected.items():
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(counts.get(pair, 0) - draws * p) < 4 * sigma
    fresh = MultilingualBatches(encoded, max_tokens=4096, temperature=5.0, seed=3)
    assert [next(fresh).pair for _ in range(20)] == _pairs_at(encoded, range(20))


def _pairs_at(encoded, steps) -> list[str]:
    probe = MultilingualBatches(encoded, max_tokens=4096, temperature=5.0, seed=3)
    out = []
    for step in steps:
        probe.step = step
        out.append(probe.next_pair())
    return out


def test_token_batches_respect_max_tokens_and_vary(encoded) -> None:
    batches = MultilingualBatches(encoded, max_tokens=300, temperature=5.0, seed=0)
    shapes = set()
    for _ in range(60):
        batch = next(batches)
        assert batch.num_tokens <= 300
        assert batch.src_tokens.dtype == batch.tgt_in.dtype == torch.long
        assert batch.src_padding_mask.dtype == batch.tgt_padding_mask.dtype == torch.bool
        assert (batch.tgt_in[:, 0] == 2).all()
        assert ((batch.tgt_out == 3).sum(dim=1) == 1).all()
        shifted = batch.tgt_out[:, :-1]
        assert torch.equal(batch.tgt_in[:, 1:], shifted.masked_fill(shifted == 3, 0))
        shapes.add((batch.src_tokens.shape[1], batch.tgt_in.shape[0]))
    assert len({s for s, _ in shapes}) > 1 and len({b for _, b in shapes}) > 1


def test_token_batches_cover_each_example_once() -> None:
    sizes = [5, 9, 3, 40, 12, 7, 7, 1, 30, 120]
    batches = token_batches(sizes, 60, np.random.default_rng(0))
    flat = sorted(i for b in batches for i in b)
    assert flat == [i for i, n in enumerate(sizes) if n <= 60]
    assert all(len(b) * max(sizes[i] for i in b) <= 60 for b in batches)


def test_iterator_state_restores_the_same_next_batches(encoded) -> None:
    batches = MultilingualBatches(encoded, max_tokens=400, temperature=2.0, seed=7)
    for _ in range(40):  # long enough for small pairs to start a new epoch
        next(batches)
    state = json.loads(json.dumps(batches.state_dict()))
    expected = [next(batches) for _ in range(8)]
    resumed = MultilingualBatches(encoded, max_tokens=400, temperature=2.0, seed=7)
    resumed.load_state_dict(state)
    for a, b in zip(expected, [next(resumed) for _ in range(8)], strict=True):
        assert a.pair == b.pair
        assert torch.equal(a.src_tokens, b.src_tokens) and torch.equal(a.tgt_out, b.tgt_out)
    assert max(state["epoch"].values()) >= 1
    other = MultilingualBatches(encoded, max_tokens=400, temperature=2.0, seed=8)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_eval_batches_keep_every_example(encoded) -> None:
    examples = encoded["xa-en"][:50]
    seen = []
    for indices, batch in eval_batches(examples, "xa-en", max_tokens=200):
        assert batch.src_tokens.shape[0] == len(indices)
        for row, index in enumerate(indices):
            length = len(examples[index][0])
            assert batch.src_tokens[row, :length].tolist() == examples[index][0]
        seen += indices
    assert sorted(seen) == list(range(50))
