"""Held-out BLEU decoded through a pipe's stages with their caches (``pipelined_decode``):
the reference decoder's tokens, and the same figures as the whole plain model's evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.data.translation.bleu import HeldOutBleu
from giantpipe.data.translation.decoding import beam_search, greedy_decode, pipelined_decode
from giantpipe.data.translation.files import load_parallel_corpus
from giantpipe.data.translation.generated import write_synthetic_corpus
from giantpipe.data.translation.vocabulary import SharedVocabulary
from giantpipe.engine.inference import PipedModel
from models.transformer import transformer_t

torch.set_num_threads(1)  # tiny ops: more threads only contend on a shared machine

PAD = 0


def tiny_model(vocab: int = 30) -> nn.Sequential:
    torch.manual_seed(0)
    return transformer_t(
        1, 32, 2, d_model=16, head_dim=8, vocab_size=vocab, max_len=32, dropout=0.1
    ).eval()


@pytest.mark.parametrize("beam_size", [1, 3])
def test_pipelined_decode_equals_the_reference_up_to_the_position_table(beam_size: int) -> None:
    src = torch.randint(4, 30, (5, 14), generator=torch.Generator().manual_seed(0))
    src[1, 9:] = PAD
    model = tiny_model()
    if beam_size == 1:
        reference = greedy_decode(model, src)  # 1.5 * 14 + 10 > 31 positions: capped at 31
    else:
        reference = beam_search(model, src, beam_size=beam_size)
    pipe = GPipe(tiny_model(), balance=[2, 2], devices=["cpu", "cpu"], chunks=3)
    assert pipelined_decode(pipe, src, beam_size=beam_size) == reference
    assert max(len(t) for t in reference) > 20  # reaches the cap somewhere


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, SharedVocabulary]:
    out: Path = tmp_path_factory.mktemp("synthetic")
    files = write_synthetic_corpus(out / "data", num_languages=2, train_sizes=[600, 150], seed=0)
    train = load_parallel_corpus([files["train"]])
    test = {pair: rows[:5] for pair, rows in load_parallel_corpus([files["test"]]).items()}
    return test, SharedVocabulary.train_or_load(train, out / "spm", vocab_size=200)


def test_held_out_bleu_through_the_pipe_equals_the_whole_model(synthetic: tuple) -> None:
    test, vocab = synthetic
    scorer = HeldOutBleu(vocab, test, beam_size=2, max_tokens=64, force=True, max_source_len=32)
    whole = scorer(tiny_model(vocab.vocab_size))
    pipe = GPipe(tiny_model(vocab.vocab_size), balance=[1, 2, 1], devices=["cpu"] * 3, chunks=2)
    piped = scorer(PipedModel(pipe))  # what the runner hands every hook
    assert HeldOutBleu.generates
    speed = "decode_tokens_per_s"
    assert {k: v for k, v in piped.items() if k != speed} == {
        k: v for k, v in whole.items() if k != speed
    }
    assert piped[speed] > 0
