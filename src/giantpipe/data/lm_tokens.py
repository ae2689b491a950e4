"""The ``data=lm_tokens`` option: generated token walks for the decoder-only Transformer-L.

Token walks through a fixed random successor table (each token may be followed by ``branching``
tokens), batches of the shape the paper's Tables 1 and 2 need; the loss falls from ln V towards
ln(branching). Training batches are a pure function of (seed, position), so a resumed run sees
the batches an uninterrupted one would have seen. Fields: ``LMTokensDataConfig``
(:mod:`giantpipe.data.options`).

Example::

    from giantpipe.data.lm_tokens import lm_tokens

    tokens, next_tokens = next(lm_tokens(vocab_size=1000, seq_len=64).train_batches(0, 0))
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from giantpipe.data.bundle import Batch, DataBundle
from giantpipe.engine.generate import Decoding
from giantpipe.engine.inference import PipedModel

HELD_OUT_INDEX = 1 << 20  # eval batches are drawn as if far past any training position


def successor_table(vocab_size: int, branching: int, seed: int) -> Tensor:
    """[vocab_size, branching] int64: the tokens allowed to follow each token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (vocab_size, branching), generator=generator)


def token_walks(table: Tensor, batch_size: int, length: int, generator: torch.Generator) -> Tensor:
    """[batch_size, length] token walks through ``table`` from uniformly drawn first tokens."""
    vocab_size, branching = table.shape
    tokens = torch.empty(batch_size, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    choices = torch.randint(0, branching, (batch_size, length), generator=generator)
    for t in range(1, length):
        tokens[:, t] = table[tokens[:, t - 1], choices[:, t]]
    return tokens


def token_batch(
    table: Tensor, batch_size: int, seq_len: int, seed: int, index: int, held_out: bool = False
) -> Batch:
    """Batch number ``index`` of the stream ``seed``: (tokens, next tokens), [B, seq_len] each.

    A ``held_out`` batch starts one draw into its generator's stream. Generators take 32 bits
    of their seed, so every key ``seed * 1_000_003 + index`` is some training batch's key (with
    the data seed 1234, trainer.seed 1235 met held-out batch 0 as its training batch 48573);
    no training batch starts one draw in.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    if held_out:
        torch.randint(2, (1,), generator=generator)
    walk = token_walks(table, batch_size, seq_len + 1, generator)
    return walk[:, :-1].contiguous(), walk[:, 1:].contiguous()


def token_stream(
    table: Tensor, batch_size: int, seq_len: int, seed: int, position: int
) -> Iterator[Batch]:
    """Endless batches from ``position`` on; each depends only on (seed, its index)."""
    index = position
    while True:
        yield token_batch(table, batch_size, seq_len, seed, index)
        index += 1


class WalkSamples:
    """``evaluate_model`` of ``data=lm_tokens`` with ``eval_samples`` > 0: the model continues a
    fixed list of prompts (the first ``PROMPT_TOKENS`` of held-out walks) greedily, through the
    pipe's stages with their key/value caches (:mod:`giantpipe.engine.generate`). Returns the
    samples as text (``samples``: logged, in the summary) and ``sample_valid``, the share of
    generated steps the successor table allows (1.0: the model learnt the walks; about
    branching / vocab_size untrained).

    Example::

        hook = WalkSamples(table, prompts=held_out[0][0][:3, :8], length=16)
        hook(PipedModel(pipe))     # {"samples": "12 7 ... -> 40 3 ...", "sample_valid": 0.97}
    """

    generates = True  # it decodes: the model's children must keep key/value caches
    config_key = "data.eval_samples"  # what asked for it, if the model cannot generate

    def __init__(self, table: Tensor, prompts: Tensor, length: int) -> None:
        self.table, self.prompts, self.length = table, prompts, length

    def __call__(self, model: PipedModel) -> dict[str, float | str]:
        out = model.generate([self.prompts], [self.length], Decoding())[0]
        lines, allowed, steps = [], 0, 0
        for prompt, tokens in zip(self.prompts.tolist(), out, strict=True):
            walk = prompt[-1:] + tokens
            for a, b in zip(walk, walk[1:], strict=False):
                allowed += int(b in self.table[a].tolist())
                steps += 1
            lines.append(" ".join(map(str, prompt)) + " -> " + " ".join(map(str, tokens)))
        return {"samples": " | ".join(lines), "sample_valid": allowed / max(steps, 1)}


PROMPT_TOKENS, SAMPLE_TOKENS = 8, 24


def lm_tokens(
    vocab_size: int = 32000,
    seq_len: int = 1024,
    batch_size: int = 32,
    batches_per_epoch: int = 1000,
    eval_batches: int = 2,
    branching: int = 4,
    seed: int = 1234,
    eval_samples: int = 0,
) -> DataBundle:
    """Generated language-model batches (fields: ``LMTokensDataConfig``).

    Example::

        bundle = lm_tokens(vocab_size=1000, seq_len=64, batch_size=8)
        bundle.tokens_per_batch(next(bundle.train_batches(0, 0)))      # 512
    """
    table = successor_table(vocab_size, branching, seed)
    held_out = [
        token_batch(table, batch_size, seq_len, seed, HELD_OUT_INDEX + i, held_out=True)
        for i in range(eval_batches)
    ]
    samples = None
    if eval_samples > 0:
        first = held_out[0][0]
        assert isinstance(first, Tensor)
        size = min(PROMPT_TOKENS, seq_len // 2)  # prompt and sample within seq_len positions
        length = min(SAMPLE_TOKENS, seq_len - size)
        samples = WalkSamples(table, first[:eval_samples, :size], length)
    return DataBundle(
        train_batches=lambda run_seed, position: token_stream(
            table, batch_size, seq_len, run_seed, position
        ),
        eval_batches=lambda: held_out,
        batches_per_epoch=batches_per_epoch,
        loss="cross_entropy",
        metric="accuracy",
        tokens_per_batch=lambda batch: batch[1].numel(),  # type: ignore[union-attr]
        evaluate_model=samples,
    )
