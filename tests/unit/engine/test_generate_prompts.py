"""Prompts of unequal length and the modes generation leaves (engine/generate/prompts.py,
``generate``'s :func:`evaluating`): a micro-batch of ragged rows, or of rows left-padded with
``Decoding.pad_id``, decodes each row as that prompt alone (the Transformer LM, greedy, beam and
sampled, one stage and two), bad rows are refused in one line naming the row; after
``generate`` (also a failed one) and the translation decoders every module is in the mode it
was in before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.data.translation.decoding import beam_search, greedy_decode
from giantpipe.engine.generate import Decoding, generate, padded_prompt
from models.transformer import transformer_lm
from tests.timeouts import scaled
from tests.unit.engine.seq2seq import BOS, PAD, seq2seq

torch.set_num_threads(1)  # tiny ops: more threads only contend on a shared machine

VOCAB, STEPS = 41, 8
ROWS = [[5, 17, 9, 30, 2, 11], [8, 9], [4, 4, 21, 6]]  # three lengths in one micro-batch
PAD_ID = 0


def lm() -> nn.Sequential:
    torch.manual_seed(3)
    model = transformer_lm(3, d_model=32, ffn_dim=48, num_heads=4, vocab_size=VOCAB, max_len=48)
    return model.eval()


def alone(model: nn.Module, decoding: Decoding) -> list[list[int]]:
    """Each row of :data:`ROWS` decoded by itself: a micro-batch of one unpadded row."""
    return [generate(model, [torch.tensor([row])], [STEPS], decoding)[0][0] for row in ROWS]


@pytest.mark.parametrize("decoding", [Decoding(), Decoding(beam_size=3, eos_id=7)])
def test_ragged_rows_decode_each_as_its_prompt_alone(decoding: Decoding) -> None:
    want = alone(lm(), decoding)
    assert len({tuple(row) for row in want}) == 3
    assert generate(lm(), [ROWS], [STEPS], decoding) == [want]
    pipe = GPipe(lm(), balance=[2, 2, 1], devices=["cpu"] * 3, chunks=2)
    got = generate(pipe, [ROWS[:2], ROWS[2:]], [STEPS, STEPS], decoding)  # K = 3, M = 2
    assert got == [want[:2], want[2:]]


def test_ragged_rows_sample_alike_through_one_stage_and_three() -> None:
    decoding = Decoding(temperature=0.9, top_k=8, seed=2)
    one = generate(lm(), [ROWS], [STEPS], decoding)
    pipe = GPipe(lm(), balance=[2, 2, 1], devices=["cpu"] * 3, chunks=1)
    assert generate(pipe, [ROWS], [STEPS], decoding) == one
    assert one != generate(lm(), [ROWS], [STEPS], Decoding())  # it sampled


def test_rows_left_padded_with_pad_id_decode_as_alone() -> None:
    tokens, keep = padded_prompt(ROWS, pad_id=0)
    assert tokens[1].tolist() == [0, 0, 0, 0, 8, 9] and keep.sum(dim=1).tolist() == [6, 2, 4]
    want = alone(lm(), Decoding(pad_id=0))
    assert generate(lm(), [tokens], [STEPS], Decoding(pad_id=0)) == [want]
    # without pad_id the zeros are tokens: the padded rows continue something else
    assert generate(lm(), [tokens], [STEPS], Decoding())[0][1] != want[1]


def test_a_pad_id_inside_a_prompt_is_one_of_its_tokens() -> None:
    """The pad token may also be a token of a prompt: only the padding in front of a row is
    masked. Each row, given as a list or left-padded in a tensor, decodes as that prompt alone
    with no pad_id at all (nothing masked); a list row may even begin with the pad token."""
    inner = [[5, 0, 9, 30, 0, 11], [8, 0, 9], [0, 4, 21, 6]]
    plain = [generate(lm(), [torch.tensor([row])], [STEPS], Decoding())[0][0] for row in inner]
    assert not any(PAD_ID in out for out in plain)  # so the batched output drops nothing
    got = generate(lm(), [inner], [STEPS], Decoding(pad_id=PAD_ID))
    assert got == [plain]
    padded = torch.tensor([inner[0], [PAD_ID] * 3 + inner[1]])  # a tensor: leading pads only
    got = generate(lm(), [padded], [STEPS], Decoding(pad_id=PAD_ID))
    assert got == [plain[:2]]


def test_the_prompt_rows_and_the_padding_are_checked() -> None:
    cases = [
        ([[1, 2], []], "prompt row 1 of micro-batch 0 is empty"),
        ([[1, 2], "3 4"], "prompt row 1 of micro-batch 0 is a str; give a list of token ids"),
        ([[1, 2.5]], "prompt row 0 of micro-batch 0 holds 2.5; token ids are ints"),
        ([torch.zeros(2, 2, dtype=torch.long)], "row 0 of micro-batch 0 is a tensor of shape"),
    ]
    for rows, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(lm(), [rows], [STEPS], Decoding())
    padded = torch.tensor([[0, 0, 0], [0, 4, 5]])
    with pytest.raises(ValueError, match="row 0 of micro-batch 1 is all padding"):
        generate(lm(), [torch.tensor([[1]]), padded], [STEPS, STEPS], Decoding(pad_id=0))
    right = torch.tensor([[4, 5, 0], [4, 5, 6]])
    with pytest.raises(ValueError, match="row 0 of micro-batch 0 ends with pad_id=0: pad .* left"):
        generate(lm(), [right], [STEPS], Decoding(pad_id=0))
    with pytest.raises(ValueError, match="2 micro-batches of prompts but 1 steps"):
        generate(lm(), [ROWS, ROWS], [STEPS], Decoding())


def modes(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def mixed(model: nn.Module) -> nn.Module:
    """Some modules training, some not (a user's fine-tuning with frozen dropout, say)."""
    model.train()
    for i, module in enumerate(model.modules()):
        if i % 3 == 1:
            module.eval()
    return model


def test_generate_leaves_each_module_in_the_mode_it_found_also_on_error() -> None:
    model = mixed(lm())
    before = modes(model)
    generate(model, [ROWS], [STEPS], Decoding())
    assert modes(model) == before
    pipe = GPipe(model, balance=[2, 2, 1], devices=["cpu"] * 3, chunks=2)
    before = modes(pipe)
    assert before[0] and not all(before)  # the pipe trains; some of its modules do not
    generate(pipe, [ROWS], [STEPS], Decoding(beam_size=2))
    assert modes(pipe) == before
    with pytest.raises(IndexError):  # an id beyond the vocabulary fails in the embedding
        generate(pipe, [[[VOCAB + 5]]], [STEPS], Decoding(), timeout=scaled(30.0))
    assert modes(pipe) == before


def test_the_translation_decoders_leave_each_module_as_they_found_it() -> None:
    model = mixed(seq2seq())
    before = modes(model)
    src = torch.randint(4, 37, (3, 5), generator=torch.Generator().manual_seed(1))
    greedy_decode(model, src)
    beam_search(model, src, beam_size=2)
    assert modes(model) == before


def test_a_padded_source_translates_as_that_source_alone() -> None:
    """The encoder-decoder's source padding (right, masked) was already exact: a padded row
    of the batch equals the same sentence decoded by itself."""
    src = torch.randint(4, 37, (3, 6), generator=torch.Generator().manual_seed(2))
    src[1, 3:] = PAD
    model = seq2seq()
    batch = generate(model, [(src, torch.full((3, 1), BOS))], [12], Decoding(eos_id=3, pad_id=0))
    one = generate(model, [(src[1:2, :3], torch.full((1, 1), BOS))], [12], Decoding(eos_id=3))
    assert batch[0][1] == one[0][0]
