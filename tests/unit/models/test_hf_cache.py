"""Key/value caches for Hugging Face causal LMs taken in with ``sequentialize`` (models/hf.py):
cached, pipelined decoding through ``GPipe`` equals the plain Hugging Face model decoding
without a cache (its full forward re-run on the whole prefix at every step), token for token,
greedy and beam (fp32), for K = 1..4 stages and M = 1..4 micro-batches; sampling is the same
for K = 1 and K = 3; other types, and cuts inside a decoder layer, are refused by name; a
piece keeps only its own weights."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from giantpipe import GPipe, sequentialize
from giantpipe.engine.generate import Decoding, generate, split_rows
from giantpipe.engine.generate.search import BeamSearch, RowSearch

pytest.importorskip("transformers")
from models.hf import LLAMA_FAMILY, give_caches, hf_causal_lm  # noqa: E402
from tests.timeouts import scaled

torch.set_num_threads(1)  # tiny ops: more threads only contend on a shared machine

VOCAB, LAYERS, STEPS = 50, 3, 10
BALANCES = {1: [5], 2: [2, 3], 3: [2, 2, 1], 4: [1, 2, 1, 1]}  # embed, 3 layers, head
# mistral with a window of 4 (prompt 5 + 10 steps): its layers mask and cache a sliding window
ARCHITECTURES = {"gpt2": {}, "llama": {}, "mistral": {"sliding_window": 4}}


def build(architecture: str) -> nn.Module:
    kv_heads = None if architecture == "gpt2" else 2  # grouped queries where the type has them
    # weights 15 times the default's spread: attention that looks at positions (at 0.02 random
    # attention is near uniform, and a wrong position would change no arg-max)
    config = {"initializer_range": 0.3, **ARCHITECTURES[architecture]}
    model = hf_causal_lm(architecture, LAYERS, 32, 4, VOCAB, kv_heads, max_len=64, config=config)
    return model.eval()


def uncached(model: nn.Module, prompts: Tensor, decoding: Decoding, m: int = 0) -> list:
    """The reference: the engine's search on the logits of the plain model's full forward
    over each row's whole prefix, at every step (rows reordered as the search says)."""
    rows = len(prompts)
    search: Any = (
        BeamSearch(rows, STEPS, decoding)
        if decoding.beam_size > 1
        else RowSearch(rows, STEPS, decoding, m)
    )
    prefix = prompts
    with torch.no_grad():
        while True:
            step = search.advance(model(input_ids=prefix).logits[:, -1])
            if step is None:
                return search.result()
            tokens, order = step
            prefix = torch.cat([prefix if order is None else prefix[order], tokens], dim=1)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def captured(request: pytest.FixtureRequest) -> dict[str, Any]:
    model = build(request.param)
    prompts = torch.randint(1, VOCAB, (6, 5), generator=torch.Generator().manual_seed(5))
    seq = sequentialize(model, prompts, output="logits")
    give_caches(model, list(seq), seq.spans)
    free = uncached(model, prompts, Decoding())
    eos = free[0][2]  # the third token of row 0 ends it: rows leave the caches at their </s>
    return {
        "architecture": request.param,
        "model": model,
        "seq": seq,
        "prompts": prompts,
        "free": free,
        "eos": eos,
        "greedy": uncached(model, prompts, Decoding(eos_id=eos)),
        "beam": uncached(model, prompts, Decoding(beam_size=3, eos_id=eos)),
    }


def pipelined(captured: dict[str, Any], k: int, m: int, decoding: Decoding) -> list[list[int]]:
    seq = captured["seq"]
    pipe = GPipe(seq, balance=BALANCES[k], devices=["cpu"] * k, chunks=m) if k > 1 else seq
    prompts = split_rows(captured["prompts"], m)
    out = generate(pipe, prompts, [STEPS] * len(prompts), decoding, timeout=scaled(60.0))
    return [row for chunk in out for row in chunk]


@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 4), (3, 2), (4, 3)])
def test_greedy_through_the_pipe_equals_the_uncached_model(
    captured: dict[str, Any], k: int, m: int
) -> None:
    assert pipelined(captured, k, m, Decoding()) == captured["free"]
    assert pipelined(captured, k, m, Decoding(eos_id=captured["eos"])) == captured["greedy"]


@pytest.mark.parametrize(("k", "m"), [(1, 2), (3, 3), (4, 1)])
def test_beam_through_the_pipe_equals_the_uncached_model(
    captured: dict[str, Any], k: int, m: int
) -> None:
    got = pipelined(captured, k, m, Decoding(beam_size=3, eos_id=captured["eos"]))
    assert got == captured["beam"]


def test_the_references_are_not_trivial(captured: dict[str, Any]) -> None:
    assert captured["beam"] != captured["greedy"]
    assert captured["greedy"][0] == captured["free"][0][:2]  # row 0 stopped at its </s>
    assert len({tuple(row) for row in captured["free"]}) > 1


def test_sampling_is_the_same_for_one_and_three_stages(captured: dict[str, Any]) -> None:
    decoding = Decoding(temperature=0.9, top_k=8, top_p=0.95, seed=4)
    alone = pipelined(captured, 1, 1, decoding)
    assert pipelined(captured, 3, 1, decoding) == alone
    assert alone == uncached(captured["model"], captured["prompts"], decoding)
    assert alone != captured["free"]  # it sampled


@pytest.mark.slow  # a capture per type: minutes
@pytest.mark.parametrize("architecture", LLAMA_FAMILY)
def test_every_listed_type_gives_the_logits_of_its_full_forward(architecture: str) -> None:
    """How the family was found: prompt, then one token at a time through the cached pieces,
    against the plain model's full forward over the whole prefix (a sliding window of 4, where
    the type has one, is passed by the 12 positions)."""
    import transformers

    known = transformers.AutoConfig.for_model(architecture)
    config: dict[str, Any] = {"initializer_range": 0.3}  # attention that sees positions
    if hasattr(known, "sliding_window"):
        config["sliding_window"] = 4
    if hasattr(known, "use_sliding_window"):  # qwen2, qwen3: layer 0 full, the others windowed
        config |= {"use_sliding_window": True, "max_window_layers": 1}
    model = hf_causal_lm(architecture, 3, 32, 4, VOCAB, 2, max_len=64, config=config).eval()
    ids = torch.randint(1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(5))
    seq = sequentialize(model, ids[:, :5], output="logits")
    give_caches(model, list(seq), seq.spans)
    caches: list[Any] = [None] * len(seq)
    with torch.no_grad():
        for end in range(5, 13):
            x: Any = ids[:, :5] if end == 5 else ids[:, end - 1 : end]
            for i, piece in enumerate(seq):
                x, caches[i] = piece.forward_cached(x, caches[i])
            want = model(input_ids=ids[:, :end]).logits[:, -1:]
            torch.testing.assert_close(x, want, atol=1e-4, rtol=1e-4)


def tiny(architecture: str, **kwargs: Any) -> tuple[nn.Module, Any]:
    model = hf_causal_lm(architecture, layers=2, width=16, heads=2, vocab_size=VOCAB).eval()
    seq = sequentialize(model, torch.randint(0, VOCAB, (2, 4)), output="logits", **kwargs)
    give_caches(model, list(seq), seq.spans)
    return model, seq


def test_another_type_is_refused_by_name_with_the_supported_ones() -> None:
    _, seq = tiny("gpt_neox")
    with pytest.raises(TypeError, match="'gpt_neox' has no key/value cache.*gpt2, .*llama, "):
        generate(seq, [torch.zeros(2, 3, dtype=torch.long)], [4], Decoding())


def test_a_cut_inside_a_decoder_layer_is_refused() -> None:
    _, seq = tiny("llama", split_points=["model.layers.1.mlp"])
    with pytest.raises(TypeError, match="model.layers.1 is cut across pieces"):
        generate(seq, [torch.zeros(2, 3, dtype=torch.long)], [4], Decoding())


def test_a_piece_keeps_no_other_pieces_weights_alive() -> None:
    model, seq = tiny("llama")
    others = [weakref.ref(p) for p in [*seq[0].parameters(), *seq[2].parameters()]]
    assert all(p() is not None for p in others)
    kept = seq[1]  # decoder layer 0 alone, as a rank of its stage keeps it
    del model, seq
    gc.collect()
    assert all(p() is None for p in others)
    hidden = torch.randn(2, 3, 16)
    cos, sin = torch.ones(1, 3, 8), torch.zeros(1, 3, 8)
    out, cache = kept.forward_cached((hidden, cos, sin), None)
    assert out[0].shape == (2, 3, 16) and cache.length == 3


def test_tied_embeddings_decode_as_the_plain_model() -> None:
    """GPT-2 with one table for input and output: the first and last pieces share it (the
    engine's per-stage copies), and each piece's decoder runs on the copy its piece holds."""
    model = hf_causal_lm(
        "gpt2", 2, 32, 4, VOCAB, tie_embeddings=True, config={"initializer_range": 0.3}
    ).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    prompts = torch.randint(1, VOCAB, (4, 5), generator=torch.Generator().manual_seed(2))
    seq = sequentialize(model, prompts, output="logits")
    give_caches(model, list(seq), seq.spans)
    pipe = GPipe(seq, balance=[2, 2], devices=["cpu"] * 2, chunks=2)
    out = generate(pipe, split_rows(prompts, 2), [STEPS] * 2, Decoding())
    assert [row for chunk in out for row in chunk] == uncached(model, prompts, Decoding())


def test_virtual_stages_decode_as_the_uncached_model(captured: dict[str, Any]) -> None:
    """Two workers of two interleaved virtual stages each: a piece's cache lives where it runs."""
    pipe = GPipe(
        captured["seq"],
        balance=[2, 1, 1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        schedule="interleaved",
        virtual_stages=2,
    )
    out = generate(pipe, split_rows(captured["prompts"], 2), [STEPS] * 2, Decoding())
    assert [row for chunk in out for row in chunk] == captured["free"]


FAMILIES = {"gpt2": {}, "llama": {}, "mistral": {"sliding_window": 4}, "qwen2": {}}
RAGGED = [[5, 17, 9, 30, 2, 11], [8, 9], [4, 4, 21, 6], [33, 12, 40]]  # one to four pads


def family(architecture: str) -> nn.Module:
    kv_heads = None if architecture == "gpt2" else 2
    config = {"initializer_range": 0.3, **FAMILIES[architecture]}  # attention that sees positions
    return hf_causal_lm(architecture, 2, 32, 4, VOCAB, kv_heads, max_len=64, config=config).eval()


@pytest.mark.parametrize(
    "architecture",
    # GPT-2 (learnt positions) and Llama (rotary) in the everyday lane; the windowed and the
    # biased-attention variants of Llama's forward in the full suite (a capture each: seconds)
    ["gpt2", "llama", *(pytest.param(a, marks=pytest.mark.slow) for a in ("mistral", "qwen2"))],
)
def test_prompts_of_unequal_length_decode_as_alone_and_as_hugging_face(architecture: str) -> None:
    """Ragged rows in two micro-batches through two stages: each row's greedy tokens equal the
    plain model's on that prompt alone and Hugging Face's ``generate`` on the left-padded batch
    with its attention mask; beam search equals each prompt alone too."""
    model = family(architecture)
    seq = sequentialize(model, torch.randint(1, VOCAB, (2, 5)), output="logits")
    give_caches(model, list(seq), seq.spans)
    pipe = GPipe(seq, balance=[2, 2], devices=["cpu"] * 2, chunks=2)
    micro = [RAGGED[:2], RAGGED[2:]]
    greedy = generate(pipe, micro, [STEPS] * 2, Decoding(), timeout=scaled(60.0))
    alone = [uncached(model, torch.tensor([row]), Decoding())[0] for row in RAGGED]
    assert [row for chunk in greedy for row in chunk] == alone
    width = max(map(len, RAGGED))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in RAGGED])
    mask = (ids != 0).long().cummax(dim=1).values  # the rows have no token 0
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert out[:, width:].tolist() == alone
    beam = Decoding(beam_size=3, eos_id=alone[0][3])
    got = generate(pipe, micro, [STEPS] * 2, beam, timeout=scaled(60.0))
    want = [uncached(model, torch.tensor([row]), beam)[0] for row in RAGGED]
    assert [row for chunk in got for row in chunk] == want


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_generate_leaves_the_hugging_face_model_in_its_modes_also_on_error(mode: str) -> None:
    """GPT-2 with dropout, captured and pipelined: its dropout modules are both the pieces'
    (the captured graph calls them) and the cached decoders' (they run the original
    submodules); generate must leave each one as it was, however it ends."""
    model = hf_causal_lm("gpt2", 2, 32, 4, VOCAB, dropout=0.1).train(mode == "train")
    seq = sequentialize(model, torch.randint(1, VOCAB, (2, 5)), output="logits")
    give_caches(model, list(seq), seq.spans)
    pipe = GPipe(seq, balance=[2, 2], devices=["cpu"] * 2, chunks=2)
    every = [*model.modules(), *pipe.modules()]
    before = [m.training for m in every]
    assert any(before) and (mode == "train") == all(m.training for m in model.modules())
    generate(pipe, [RAGGED[:2], RAGGED[2:]], [4, 4], Decoding(), timeout=scaled(60.0))
    assert [m.training for m in every] == before
    with pytest.raises(IndexError):  # an id beyond the vocabulary fails in the first piece
        generate(pipe, [[[VOCAB + 3]]], [4], Decoding(), timeout=scaled(60.0))
    assert [m.training for m in every] == before
