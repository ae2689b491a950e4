"""Every generated data option keeps its evaluation samples out of its training samples: an
evaluation drawn from the training stream would report memorisation as generalisation, and
nothing else would notice (the loss still falls, the run still completes)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from pathlib import Path

import torch

from giantpipe.data.bundle import DataBundle
from giantpipe.data.images.bundle import generated_images, random_images
from giantpipe.data.lm_tokens import HELD_OUT_INDEX, lm_tokens
from giantpipe.data.synthetic import classification
from giantpipe.data.translation.generated import write_synthetic_corpus

SEEDS = (0, 1, 7, 1234)  # trainer.seed (1234: the data seed too): for lm_tokens the stream


def rows(batches: Iterable[tuple[torch.Tensor, ...]]) -> set[bytes]:
    """Each sample (input and target) as bytes."""
    out = set()
    for inputs, targets in batches:
        for x, y in zip(inputs, targets):
            out.add(x.numpy().tobytes() + b"|" + y.numpy().tobytes())
    return out


def train_rows(bundle: DataBundle, batches: int) -> set[bytes]:
    found: set[bytes] = set()
    for seed in SEEDS:
        found |= rows(islice(bundle.train_batches(seed, 0), batches))
    return found


def inputs_only(batches: Iterable[tuple[torch.Tensor, ...]]) -> set[bytes]:
    return {x.numpy().tobytes() for inputs, _ in batches for x in inputs}


def test_synthetic_classification_splits_are_disjoint() -> None:
    bundle = classification(features=4, classes=3, train_size=256, eval_size=64, batch_size=16)
    train = inputs_only(islice(bundle.train_batches(0, 0), bundle.batches_per_epoch))
    held_out = inputs_only(bundle.eval_batches())
    assert len(train) == 256 and len(held_out) == 64
    assert not train & held_out


def test_generated_images_splits_are_disjoint() -> None:
    bundle = generated_images(image_size=8, train_size=64, eval_size=32, batch_size=16)
    train = inputs_only(islice(bundle.train_batches(0, 0), bundle.batches_per_epoch))
    held_out = inputs_only(bundle.eval_batches())
    assert len(train) == 64 and len(held_out) == 32
    assert not train & held_out


def test_random_images_evaluate_on_another_batch() -> None:
    bundle = random_images(image_size=4, num_classes=10, batch_size=8)
    train = inputs_only(islice(bundle.train_batches(0, 0), 3))
    held_out = inputs_only(bundle.eval_batches())
    assert len(held_out) == 8 and not train & held_out


def test_lm_tokens_splits_are_disjoint() -> None:
    bundle = lm_tokens(vocab_size=50, seq_len=16, batch_size=4, branching=4, eval_batches=3)
    held_out = rows(bundle.eval_batches())
    assert len(held_out) == 12
    assert not train_rows(bundle, 50) & held_out


def test_lm_tokens_no_training_batch_shares_a_held_out_key() -> None:
    # A batch is drawn from a generator seeded with seed * 1_000_003 + index, of which torch
    # keeps 32 bits: for any run seed, some training position has each held-out batch's key
    # (trainer.seed = data.seed + 1: position 48573). The batches there must still differ.
    data_seed, eval_batches = 1234, 3
    bundle = lm_tokens(vocab_size=50, seq_len=16, batch_size=4, eval_batches=eval_batches)
    held_out = rows(bundle.eval_batches())
    for run_seed in (0, data_seed - 1, data_seed, data_seed + 1, data_seed + 2):
        for i in range(eval_batches):
            key = data_seed * 1_000_003 + HELD_OUT_INDEX + i
            position = (key - run_seed * 1_000_003) % 2**32
            batch = next(bundle.train_batches(run_seed, position))
            assert not rows([batch]) & held_out, (run_seed, position)


def test_generated_translation_corpus_splits_are_disjoint(tmp_path: Path) -> None:
    files = write_synthetic_corpus(tmp_path, num_languages=2, train_sizes=[3000, 800])

    def pairs(split: str) -> set[tuple[str, str]]:
        lines = files[split].read_text(encoding="utf-8").splitlines()[1:]
        return {tuple(line.split("\t")[:2]) for line in lines}  # type: ignore[misc]

    train, valid, test = pairs("train"), pairs("valid"), pairs("test")
    assert len(valid) > 100 and len(test) > 100
    # pairs, not sources: two meanings may read the same in English and differ in the other
    # language, and each is a sentence pair of its own
    assert not train & valid and not train & test and not valid & test
