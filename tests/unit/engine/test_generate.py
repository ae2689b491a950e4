"""Generation through the local pipe (engine/generate/): cached, pipelined decoding equals the
plain model's uncached reference decoder token for token, greedy and beam, fp32, for K = 1..4
stages x M = 1..4 micro-batches; sampling is the same whatever K; children that cannot be
cached are refused by name."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.generate import Decoding, generate, split_rows
from giantpipe.engine.generate.caches import StageCaches
from models.transformer import transformer_lm
from tests.timeouts import scaled
from tests.unit.engine.seq2seq import BOS, EOS, PAD, seq2seq, translation_reference

torch.set_num_threads(1)  # tiny ops: more threads only contend on a shared machine

BALANCES = {1: [6], 2: [3, 3], 3: [2, 2, 2], 4: [1, 2, 2, 1]}  # 2 + 2L children, L = 2
CASES = list(itertools.product([1, 2, 3, 4], [1, 2, 3, 4]))


@pytest.fixture(scope="module")
def translation() -> dict[str, Any]:
    return translation_reference()


def pipelined(k: int, m: int, src: torch.Tensor, steps: int, beam: int) -> list[list[int]]:
    pipe = GPipe(seq2seq(), balance=BALANCES[k], devices=["cpu"] * k, chunks=m)
    prompts = [(s, torch.full((len(s), 1), BOS)) for s in split_rows(src, m)]
    decoding = Decoding(beam_size=beam, length_penalty=0.6, eos_id=EOS, pad_id=PAD)
    out = generate(pipe, prompts, [steps] * len(prompts), decoding, timeout=scaled(60.0))
    return [row for chunk in out for row in chunk]


@pytest.mark.parametrize(("k", "m"), CASES)
def test_pipelined_greedy_equals_the_uncached_reference(k: int, m: int, translation: dict) -> None:
    got = pipelined(k, m, translation["src"], translation["steps"], beam=1)
    assert got == translation["greedy"]


@pytest.mark.parametrize(("k", "m"), CASES)
def test_pipelined_beam_equals_the_uncached_reference(k: int, m: int, translation: dict) -> None:
    got = pipelined(k, m, translation["src"], translation["steps"], beam=3)
    assert got == translation["beam"]


def test_the_references_are_not_trivial(translation: dict) -> None:
    assert translation["greedy"] != translation["beam"]
    assert any(len(t) > 3 for t in translation["beam"])


def lm() -> nn.Sequential:
    torch.manual_seed(3)
    return transformer_lm(3, d_model=32, ffn_dim=48, num_heads=4, vocab_size=41, max_len=48).eval()


def test_sampling_is_the_same_whatever_the_number_of_stages() -> None:
    prompts = split_rows(torch.randint(0, 41, (4, 5)), 2)
    decoding = Decoding(temperature=0.9, top_k=8, top_p=0.9, seed=4)
    alone = generate(lm(), prompts, [10, 10], decoding)
    pipe = GPipe(lm(), balance=[2, 2, 1], devices=["cpu"] * 3, chunks=2)
    assert generate(pipe, prompts, [10, 10], decoding) == alone
    greedy = generate(lm(), prompts, [10, 10], Decoding())
    assert alone != greedy  # it sampled
    assert generate(lm(), prompts, [10, 10], Decoding(temperature=0.9, top_k=1)) == greedy
    assert generate(lm(), prompts, [10, 10], Decoding(temperature=0.9, top_p=1e-6)) == greedy


def test_an_lm_row_stops_at_its_eos() -> None:
    prompts = [torch.randint(0, 41, (3, 4))]
    free = generate(lm(), prompts, [12], Decoding())[0]
    eos = free[0][2]  # the third token of row 0 becomes </s>
    stopped = generate(lm(), prompts, [12], Decoding(eos_id=eos))[0]
    assert stopped[0] == free[0][:2]
    for row, tokens in zip(stopped, free, strict=True):
        assert row == tokens[: tokens.index(eos)] if eos in tokens else row == tokens


def test_a_child_without_forward_cached_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="ReLU lacks it"):
        StageCaches([lm()[0], nn.ReLU()], torch.device("cpu"))


def test_decoding_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="beam_size"):
        Decoding(beam_size=0)
    with pytest.raises(ValueError, match="top_p"):
        Decoding(temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="beam search .* or sampling"):
        Decoding(beam_size=2, temperature=1.0)


def test_a_hugging_face_type_without_caches_is_refused_by_name() -> None:
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from giantpipe import sequentialize
    from giantpipe.config import ConfigError
    from giantpipe.data.lm_tokens import lm_tokens
    from giantpipe.runner.model import check_generates
    from models.hf import give_caches, hf_causal_lm

    model = hf_causal_lm("gpt_neox", layers=1, width=16, heads=2, vocab_size=41, max_len=32)
    ids = torch.randint(0, 41, (2, 6))
    seq = sequentialize(model, ids, output="logits")
    give_caches(model, list(seq), seq.spans)  # as the runner does: gpt_neox has none
    with pytest.raises(TypeError, match="captured by sequentialize .* no key/value cache"):
        generate(seq, [ids], [4], Decoding())
    bundle = lm_tokens(vocab_size=41, seq_len=16, batch_size=2, eval_samples=1)
    cfg = SimpleNamespace(model=SimpleNamespace(architecture="gpt_neox"))
    with pytest.raises(ConfigError, match="data.eval_samples.*'gpt_neox'.*gpt2, .*llama, "):
        check_generates(cfg, bundle, seq)  # type: ignore[arg-type]
    no_samples = lm_tokens(vocab_size=41, seq_len=16, batch_size=2)
    check_generates(cfg, no_samples, seq)  # type: ignore[arg-type]
