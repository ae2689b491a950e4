"""Generation through a local pipe whose workers hold several stages (engine/generate/):
interleaved (stage s on worker s % K) and zb-v (s and 2K-1-s on one worker), K = 2, V = 2.
Cached decoding, the ring traversed V times per token, equals the uncached reference token for
token, greedy and beam, fp32, M = 1..3: the translation Transformer against the reference
decoders of giantpipe.data.translation.decoding, the Transformer LM against the plain model
rerun over the whole prefix at every step (:class:`Uncached`)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from giantpipe import GPipe
from giantpipe.engine.generate import Decoding, generate, split_rows
from giantpipe.engine.generate.ring import held_stages
from models.transformer import transformer_lm
from tests.timeouts import scaled
from tests.unit.engine.seq2seq import BOS, EOS, PAD, seq2seq, translation_reference

torch.set_num_threads(1)  # tiny ops: more threads only contend on a shared machine


@pytest.fixture(scope="module")
def translation() -> dict[str, Any]:
    return translation_reference()


SCHEDULES = ["interleaved", "zb-v"]
CASES = list(itertools.product(SCHEDULES, [1, 2, 3], [1, 3]))  # schedule, M, beam


def virtual_pipe(model: nn.Sequential, schedule: str, balance: list[int]) -> GPipe:
    """K = 2 workers, V = 2 stages each. ``chunks`` is training's (interleaved wants a multiple
    of K); generation takes as many micro-batches as it is given prompts."""
    pipe = GPipe(
        model, balance, devices=["cpu", "cpu"], chunks=2, schedule=schedule, virtual_stages=2
    )
    assert len(pipe.partitions) == 4 and sorted(pipe.placement) == [0, 0, 1, 1]  # V = 2
    return pipe


@pytest.mark.parametrize(("schedule", "m", "beam"), CASES)
def test_translation_through_virtual_stages_equals_the_uncached_reference(
    schedule: str, m: int, beam: int, translation: dict
) -> None:
    pipe = virtual_pipe(seq2seq(), schedule, [1, 2, 2, 1])
    prompts = [(s, torch.full((len(s), 1), BOS)) for s in split_rows(translation["src"], m)]
    decoding = Decoding(beam_size=beam, length_penalty=0.6, eos_id=EOS, pad_id=PAD)
    out = generate(pipe, prompts, [translation["steps"]] * m, decoding, timeout=scaled(60.0))
    assert [row for chunk in out for row in chunk] == translation["greedy" if beam == 1 else "beam"]


class TokensSoFar:
    """The "cache" of :class:`Uncached`: every token so far, rows reordered as beams go."""

    def __init__(self, tokens: Tensor) -> None:
        self.tokens = tokens

    def reorder(self, index: Tensor) -> TokensSoFar:
        return TokensSoFar(self.tokens.index_select(0, index))


class Uncached(nn.Module):
    """The whole plain LM as one child that reruns every position at each step (today's O(T^2)
    decoding): the reference the cached stages must equal."""

    def __init__(self, model: nn.Sequential) -> None:
        super().__init__()
        self.model = model

    def forward_cached(
        self, tokens: Tensor, cache: TokensSoFar | None
    ) -> tuple[Tensor, TokensSoFar]:
        so_far = tokens if cache is None else torch.cat([cache.tokens, tokens], dim=1)
        return self.model(so_far), TokensSoFar(so_far)


def lm() -> nn.Sequential:
    torch.manual_seed(3)
    return transformer_lm(3, d_model=32, ffn_dim=48, num_heads=4, vocab_size=41, max_len=48).eval()


@pytest.mark.parametrize(("schedule", "m", "beam"), CASES)
def test_lm_through_virtual_stages_equals_the_uncached_reference(
    schedule: str, m: int, beam: int
) -> None:
    prompts = split_rows(
        torch.randint(0, 41, (5, 4), generator=torch.Generator().manual_seed(2)), m
    )
    decoding = Decoding(beam_size=beam, eos_id=7)
    reference = generate(nn.Sequential(Uncached(lm())), prompts, [12] * m, decoding)
    pipe = virtual_pipe(lm(), schedule, [1, 2, 1, 1])
    assert generate(pipe, prompts, [12] * m, decoding, timeout=scaled(60.0)) == reference
    assert any(len(row) >= 6 for chunk in reference for row in chunk)  # not all cut short


def test_the_reference_is_not_the_cached_decoder_itself() -> None:
    """Uncached really reruns the whole prefix: its first child sees every position."""
    seen: list[int] = []
    model = lm()
    model[0].register_forward_hook(lambda _, args, __: seen.append(args[0].shape[1]))
    generate(nn.Sequential(Uncached(model)), [torch.zeros(2, 4, dtype=torch.long)], [3], Decoding())
    assert seen == [4, 5, 6]


def test_each_worker_holds_the_stages_its_schedule_places_there() -> None:
    interleaved = virtual_pipe(lm(), "interleaved", [1, 2, 1, 1])
    zbv = virtual_pipe(lm(), "zb-v", [1, 2, 1, 1])
    assert [held_stages(interleaved.placement, w) for w in (0, 1)] == [[0, 2], [1, 3]]
    assert [held_stages(zbv.placement, w) for w in (0, 1)] == [[0, 3], [1, 2]]
