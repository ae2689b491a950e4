"""``data=lm_tokens``: shifted, deterministic, learnable walks; with ``eval_samples``, fixed
prompts continued by cached greedy decoding through the pipe (WalkSamples), scored against the
successor table; held-out perplexity."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor, nn

from giantpipe import GPipe
from giantpipe.config import ConfigError
from giantpipe.data.lm_tokens import lm_tokens
from giantpipe.data.options import LMTokensDataConfig
from giantpipe.engine.inference import PipedModel
from giantpipe.runner.evaluate import evaluate
from models.transformer import transformer_lm

torch.set_num_threads(1)  # tiny ops: more threads only contend on a shared machine

VOCAB = 40


class Oracle(nn.Module):
    """Scores the first allowed successor of the last token highest: walks the table."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = table

    def forward_cached(self, tokens: Tensor, cache: None) -> tuple[Tensor, None]:
        best = self.table[tokens[:, -1:], 0]
        return nn.functional.one_hot(best, VOCAB).float(), None


def bundle(samples: int = 3) -> object:
    return lm_tokens(
        vocab_size=VOCAB, seq_len=16, batch_size=4, eval_batches=1, eval_samples=samples
    )


def test_a_model_that_walks_the_table_scores_one_and_prints_every_prompt() -> None:
    hook = bundle().evaluate_model
    assert hook is not None and hook.generates
    figures = hook(PipedModel(nn.Sequential(Oracle(hook.table))))
    assert figures["sample_valid"] == 1.0
    lines = str(figures["samples"]).split(" | ")
    assert len(lines) == 3 and all(len(line.split(" -> ")[1].split()) == 8 for line in lines)


def test_samples_through_the_pipe_equal_the_plain_model() -> None:
    hook = bundle(2).evaluate_model
    assert hook is not None

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return transformer_lm(2, d_model=16, ffn_dim=32, num_heads=2, vocab_size=VOCAB, max_len=32)

    plain = hook(PipedModel(model()))
    piped = hook(PipedModel(GPipe(model(), balance=[2, 2], devices=["cpu", "cpu"], chunks=2)))
    assert piped == plain and 0.0 <= float(plain["sample_valid"]) < 1.0


def test_no_samples_by_default_and_at_most_a_batch() -> None:
    assert lm_tokens(vocab_size=VOCAB, seq_len=16, batch_size=4).evaluate_model is None
    with pytest.raises(ConfigError, match="data.eval_samples"):
        LMTokensDataConfig(vocab_size=VOCAB, seq_len=16, batch_size=4, eval_samples=5)


def test_held_out_perplexity_is_the_exponential_of_the_token_loss() -> None:
    data = lm_tokens(vocab_size=VOCAB, seq_len=8, batch_size=4, eval_batches=2)
    torch.manual_seed(0)
    model = transformer_lm(2, d_model=16, ffn_dim=32, num_heads=2, vocab_size=VOCAB, max_len=8)
    pipe = GPipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    figures = evaluate(pipe, data, None, "fp32", ["cpu"])
    assert figures["perplexity"] == pytest.approx(math.exp(figures["loss"]), rel=1e-9)
    assert 0.5 * VOCAB < figures["perplexity"] < 2 * VOCAB  # untrained: about the vocabulary


def test_lm_tokens_are_shifted_deterministic_and_learnable() -> None:
    bundle = lm_tokens(vocab_size=50, seq_len=16, batch_size=4, branching=2, seed=1)
    tokens, targets = next(bundle.train_batches(0, 3))
    again = list(itertools.islice(bundle.train_batches(0, 0), 4))[3]
    assert torch.equal(tokens, again[0]) and torch.equal(targets, again[1])
    assert tokens.shape == targets.shape == (4, 16)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert bundle.tokens_per_batch is not None and bundle.tokens_per_batch((tokens, targets)) == 64
    successors: dict[int, set[int]] = {}
    for a, b in zip(tokens.flatten().tolist(), targets.flatten().tolist()):
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 2  # the branching factor
