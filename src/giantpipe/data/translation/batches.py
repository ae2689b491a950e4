"""Batches of multilingual translation data: language pairs sampled by temperature, token-bucketed
batches, a resumable stream and the evaluation's fixed batches.

One language pair per batch, drawn with p_i proportional to (n_i / N)^(1/T); the format of
sources and targets: docs/your-data.md#translation.

Example::

    data = encode_corpus(corpus, vocab)                       # {pair: [(src_ids, tgt_ids), ...]}
    batches = MultilingualBatches(data, max_tokens=4096, temperature=5.0, seed=0)
    batch = next(batches)                                     # TranslationBatch
    logits = model(batch.inputs())                            # (src_tokens, tgt_in_tokens)
    state = batches.state_dict()                              # save; load_state_dict(state) resumes
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MultilingualBatches",
    "TranslationBatch",
    "collate",
    "eval_batches",
    "example_size",
    "temperature_probabilities",
    "token_batches",
]


def temperature_probabilities(
    sizes: Mapping[str, int], temperature: float = 5.0
) -> dict[str, float]:
    """p_i = q_i^(1/T) / sum_j q_j^(1/T) with q_i = n_i / N; T=1 is proportional, T->inf uniform.

    Example::

        temperature_probabilities({"en-fr": 900, "en-xh": 100}, temperature=5.0)
        # {'en-fr': 0.6083..., 'en-xh': 0.3916...}
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    total = sum(sizes.values())
    if total <= 0 or any(n < 0 for n in sizes.values()):
        raise ValueError(f"sizes must be non-negative with a positive sum, got {dict(sizes)}")
    weights = {pair: (n / total) ** (1.0 / temperature) for pair, n in sizes.items()}
    norm = sum(weights.values())
    return {pair: w / norm for pair, w in weights.items()}


def example_size(src_ids: Sequence[int], tgt_ids: Sequence[int]) -> int:
    """Padded positions an example needs: max(source length, target length + 1)."""
    return max(len(src_ids), len(tgt_ids) + 1)


def token_batches(
    sizes: Sequence[int], max_tokens: int, rng: np.random.Generator, min_sentences: int = 1
) -> list[list[int]]:
    """Group example indices into batches of ``len(batch) * max(size) <= max_tokens``.

    Length bucketing: sort by size (ties broken randomly), cut greedily, shuffle batch order.
    Examples larger than ``max_tokens`` are left out, and so are batches of fewer than
    ``min_sentences`` examples (a pipeline needs one sentence per micro-batch at least); with
    every size <= max_tokens // min_sentences only the last, longest batch can be that small.
    """
    order = rng.permutation(len(sizes))
    order = order[np.argsort(np.asarray(sizes)[order], kind="stable")] if len(sizes) else order
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order.tolist():
        size = sizes[index]
        if size > max_tokens:
            continue
        if current and (len(current) + 1) * max(longest, size) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, size)
    if current:
        batches.append(current)
    batches = [b for b in batches if len(b) >= min_sentences]
    return [batches[i] for i in rng.permutation(len(batches)).tolist()]


@dataclass
class TranslationBatch:
    """One language pair's padded batch. Masks are bool, True at padding."""

    src_tokens: Tensor  # int64 [B, S]: <2tgt> x </s>
    tgt_in: Tensor  # int64 [B, T]: <s> y
    tgt_out: Tensor  # int64 [B, T]: y </s>
    pair: str
    pad_id: int = 0

    def inputs(self) -> tuple[Tensor, Tensor]:
        """The model input tuple (src_tokens, tgt_in_tokens)."""
        return self.src_tokens, self.tgt_in

    @property
    def src_padding_mask(self) -> Tensor:
        return self.src_tokens.eq(self.pad_id)

    @property
    def tgt_padding_mask(self) -> Tensor:
        return self.tgt_out.eq(self.pad_id)

    @property
    def num_tokens(self) -> int:
        """Padded positions, counted as for ``max_tokens``: B * max(S, T)."""
        return self.src_tokens.shape[0] * max(self.src_tokens.shape[1], self.tgt_in.shape[1])


def collate(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pair: str,
    pad_id: int = 0,
    bos_id: int = 2,
    eos_id: int = 3,
) -> TranslationBatch:
    """Pad encoded examples into a ``TranslationBatch`` (right padding)."""
    src_len = max(len(s) for s, _ in examples)
    tgt_len = max(len(t) for _, t in examples) + 1
    src = torch.full((len(examples), src_len), pad_id, dtype=torch.long)
    tgt_in = torch.full((len(examples), tgt_len), pad_id, dtype=torch.long)
    tgt_out = torch.full((len(examples), tgt_len), pad_id, dtype=torch.long)
    for row, (s, t) in enumerate(examples):
        src[row, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        tgt_in[row, : len(t) + 1] = torch.tensor([bos_id, *t], dtype=torch.long)
        tgt_out[row, : len(t) + 1] = torch.tensor([*t, eos_id], dtype=torch.long)
    return TranslationBatch(src, tgt_in, tgt_out, pair, pad_id)


class MultilingualBatches(Iterator[TranslationBatch]):
    """Endless, deterministic stream of token-bucketed batches across language pairs.

    Step s draws a pair with ``temperature_probabilities`` from a generator seeded by
    (seed, s), then takes that pair's next batch; each pair walks through epochs of batches
    shuffled by (seed, pair, epoch). The whole position is three counters, so
    ``state_dict()`` / ``load_state_dict()`` resume exactly.

    Example::

        batches = MultilingualBatches(encoded, max_tokens=2048, temperature=5.0, seed=1)
        first = next(batches)
        state = batches.state_dict()
        again = MultilingualBatches(encoded, max_tokens=2048, temperature=5.0, seed=1)
        again.load_state_dict(state)       # next(again) equals next(batches)
    """

    def __init__(
        self,
        data: Mapping[str, Sequence[tuple[Sequence[int], Sequence[int]]]],
        max_tokens: int,
        *,
        temperature: float = 5.0,
        seed: int = 0,
        pad_id: int = 0,
        bos_id: int = 2,
        eos_id: int = 3,
        min_sentences: int = 1,
    ) -> None:
        sizes = {p: [example_size(s, t) for s, t in rows] for p, rows in data.items()}
        # An example fits when a batch of min_sentences such examples fits in max_tokens.
        longest = max_tokens // max(min_sentences, 1)
        fits = {p: sum(n <= longest for n in sizes[p]) for p in data}
        self.pairs = sorted(p for p in data if fits[p] >= max(min_sentences, 1))
        if not self.pairs:
            raise ValueError(
                f"no language pair has {min_sentences} example(s) that fit max_tokens={max_tokens}"
            )
        self.data = {p: data[p] for p in self.pairs}
        self.sizes = {p: sizes[p] for p in self.pairs}
        fitting = {p: fits[p] for p in self.pairs}
        self.max_tokens, self.seed, self.special = max_tokens, seed, (pad_id, bos_id, eos_id)
        self.min_sentences = min_sentences
        probs = temperature_probabilities(fitting, temperature)
        self.probabilities = np.array([probs[p] for p in self.pairs])
        self.step = 0
        self.epoch = dict.fromkeys(self.pairs, 0)
        self.cursor = dict.fromkeys(self.pairs, 0)
        self._cache: dict[str, tuple[int, list[list[int]]]] = {}

    def _batches(self, pair: str) -> list[list[int]]:
        epoch = self.epoch[pair]
        if self._cache.get(pair, (-1, []))[0] != epoch:
            rng = np.random.default_rng([self.seed, self.pairs.index(pair), epoch])
            batches = token_batches(self.sizes[pair], self.max_tokens, rng, self.min_sentences)
            self._cache[pair] = (epoch, batches)
        return self._cache[pair][1]

    def next_pair(self) -> str:
        rng = np.random.default_rng([self.seed, 1_000_003, self.step])
        return self.pairs[int(rng.choice(len(self.pairs), p=self.probabilities))]

    def _advance(self) -> tuple[str, list[int]]:
        """The next (pair, example indices), moving the position on by one batch."""
        pair = self.next_pair()
        if self.cursor[pair] >= len(self._batches(pair)):  # start the pair's next epoch
            self.epoch[pair], self.cursor[pair] = self.epoch[pair] + 1, 0
        indices = self._batches(pair)[self.cursor[pair]]
        self.cursor[pair] += 1
        self.step += 1
        return pair, indices

    def __next__(self) -> TranslationBatch:
        pair, indices = self._advance()
        pad_id, bos_id, eos_id = self.special
        return collate([self.data[pair][i] for i in indices], pair, pad_id, bos_id, eos_id)

    def skip(self, count: int) -> None:
        """Move on by ``count`` batches without building them (a resume at position ``count``).

        Example::

            stream.skip(1000)      # next(stream) is the batch an unbroken run takes 1001st
        """
        for _ in range(count):
            self._advance()

    def batches_per_epoch(self) -> int:
        """Batches in one pass over every pair's (first) epoch: the data set's epoch length."""
        return sum(
            len(
                token_batches(
                    self.sizes[p], self.max_tokens, np.random.default_rng(0), self.min_sentences
                )
            )
            for p in self.pairs
        )

    def state_dict(self) -> dict:
        """Position of the stream (plain ints, JSON-serialisable)."""
        return {
            "seed": self.seed,
            "step": self.step,
            "epoch": dict(self.epoch),
            "cursor": dict(self.cursor),
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state["seed"] != self.seed or sorted(state["epoch"]) != self.pairs:
            raise ValueError("batch-iterator state was saved for another seed or set of pairs")
        self.step = int(state["step"])
        self.epoch = {p: int(e) for p, e in state["epoch"].items()}
        self.cursor = {p: int(c) for p, c in state["cursor"].items()}


def eval_batches(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pair: str,
    max_tokens: int,
    pad_id: int = 0,
    bos_id: int = 2,
    eos_id: int = 3,
) -> Iterator[tuple[list[int], TranslationBatch]]:
    """Batches of one pair in a fixed length-sorted order, with the example indices they hold.

    Unlike training, an example longer than ``max_tokens`` is kept, alone in its batch.
    """
    sizes = [example_size(s, t) for s, t in examples]
    order = sorted(range(len(examples)), key=lambda i: (sizes[i], i))
    current: list[int] = []
    for index in order:
        if current and (len(current) + 1) * sizes[index] > max_tokens:
            yield current, collate([examples[i] for i in current], pair, pad_id, bos_id, eos_id)
            current = []
        current.append(index)
    if current:
        yield current, collate([examples[i] for i in current], pair, pad_id, bos_id, eos_id)
