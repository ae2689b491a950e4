"""Decoding a translation model: the reference greedy and beam decoders on a whole model, and the
same searches through a pipe's stages with their key/value caches.

The reference reaches the model only through what it offers (:class:`Seq2Seq`) and keeps no
cache; :func:`pipelined_decode` gives its tokens through the stages with their caches
(docs/your-data.md#translation).

Example::

    from giantpipe.data.translation.decoding import beam_search, greedy_decode

    hyps = greedy_decode(model, batch.src_tokens)   # [[17, 5, 9], [8, 4], ...]
    hyps = beam_search(model, batch.src_tokens, beam_size=4, length_penalty=0.6)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from torch import Tensor, nn

from giantpipe.engine.generate import Decoding, evaluating, generate, split_rows
from giantpipe.engine.generate.search import trim_tokens

__all__ = [
    "Seq2Seq",
    "beam_search",
    "greedy_decode",
    "is_pipe",
    "pipelined_decode",
]


class Seq2Seq(Protocol):
    """What decoding needs from a model (``models.transformer.EncoderDecoder`` offers it)."""

    @property
    def max_len(self) -> int:
        """Longest sequence the model takes (its position table)."""
        ...

    def encode(self, src_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(source states [B, S, D], source padding mask [B, S]), once per batch."""
        ...

    def decode_logits(self, src_x: Tensor, src_pad: Tensor, prefix: Tensor) -> Tensor:
        """Logits [B, T, V] for target prefixes [B, T] given :meth:`encode`'s output."""
        ...


def seq2seq(model: nn.Module) -> Seq2Seq:
    """``model`` as a :class:`Seq2Seq`; a TypeError names what it lacks."""
    missing = [a for a in ("encode", "decode_logits", "max_len") if not hasattr(model, a)]
    if missing:
        raise TypeError(
            f"decoding needs a model offering encode, decode_logits and max_len (e.g. "
            f"models.transformer.transformer_t); {type(model).__name__} lacks {missing}"
        )
    return cast(Seq2Seq, model)


def _max_steps(model: Seq2Seq, src_tokens: Tensor, max_len: int | None) -> int:
    positions = model.max_len
    wanted = max_len if max_len is not None else int(1.5 * src_tokens.shape[1]) + 10
    return max(1, min(wanted, positions - 1))


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    src_tokens: Tensor,
    *,
    max_len: int | None = None,
    bos_id: int = 2,
    eos_id: int = 3,
    pad_id: int = 0,
) -> list[list[int]]:
    """Arg-max decoding; returns one token list per source row, without <s> and </s>.

    ``max_len`` defaults to 1.5 * S + 10, capped by the model's position table.

    Example::

        hyps = greedy_decode(model, batch.src_tokens)   # [[17, 5, 9], [8, 4], ...]
    """
    with evaluating(model):  # every module left in the mode it was found in
        decoder = seq2seq(model)
        src_x, src_pad = decoder.encode(src_tokens)
        prefix = torch.full((src_tokens.shape[0], 1), bos_id, dtype=torch.long)
        prefix = prefix.to(src_tokens.device)
        finished = torch.zeros(src_tokens.shape[0], dtype=torch.bool, device=src_tokens.device)
        for _ in range(_max_steps(decoder, src_tokens, max_len)):
            logits = decoder.decode_logits(src_x, src_pad, prefix)[:, -1]
            step = logits.argmax(dim=-1).to(prefix.device)  # the head may sit on another device
            step = step.masked_fill(finished, pad_id)
            prefix = torch.cat([prefix, step[:, None]], dim=1)
            finished |= step.eq(eos_id)
            if bool(finished.all()):
                break
    return [trim_tokens(row, eos_id, pad_id) for row in prefix[:, 1:].tolist()]


def _length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha; alpha = 0 compares raw log-probs."""
    return ((5.0 + length) / 6.0) ** alpha


@dataclass
class _Beams:
    """Hypotheses of one source sentence: live (score, tokens) and finished (norm, tokens)."""

    live: list[tuple[float, list[int]]]
    done: list[tuple[float, list[int]]] = field(default_factory=list)


def _advance(beams: _Beams, logprobs: Tensor, beam_size: int, eos_id: int, alpha: float) -> _Beams:
    """One beam step for one sentence; ``logprobs`` [len(live), V].

    As in fairseq, a candidate ending in </s> is kept only if it ranks within the top
    ``beam_size``; the best ``beam_size`` other candidates stay live.
    """
    scores = torch.tensor([s for s, _ in beams.live], dtype=logprobs.dtype)[:, None] + logprobs
    top, flat = scores.flatten().topk(min(2 * beam_size, scores.numel()))
    vocab = logprobs.shape[1]
    live: list[tuple[float, list[int]]] = []
    for rank, (score, index) in enumerate(zip(top.tolist(), flat.tolist(), strict=True)):
        tokens = beams.live[index // vocab][1] + [index % vocab]
        if index % vocab == eos_id:
            if rank < beam_size and len(beams.done) < beam_size:
                beams.done.append((score / _length_penalty(len(tokens) - 1, alpha), tokens[:-1]))
        elif len(live) < beam_size:
            live.append((score, tokens))
    return _Beams(live, beams.done)


@torch.no_grad()
def beam_search(
    model: nn.Module,
    src_tokens: Tensor,
    *,
    beam_size: int = 4,
    max_len: int | None = None,
    length_penalty: float = 0.6,
    bos_id: int = 2,
    eos_id: int = 3,
    pad_id: int = 0,
) -> list[list[int]]:
    """Beam search with a GNMT length penalty; best hypothesis per row, without <s>/</s>.

    A sentence stops once ``beam_size`` hypotheses ended with </s>; at ``max_len`` the live
    ones are scored as they are. ``beam_size=1`` equals greedy decoding.

    Example::

        hyps = beam_search(model, batch.src_tokens, beam_size=4, length_penalty=0.6)
    """
    with evaluating(model):
        decoder = seq2seq(model)
        src_x, src_pad = decoder.encode(src_tokens)
        beams = [_Beams([(0.0, [bos_id])]) for _ in range(src_tokens.shape[0])]
        for _ in range(_max_steps(decoder, src_tokens, max_len)):
            active = [i for i, b in enumerate(beams) if len(b.done) < beam_size and b.live]
            if not active:
                break
            rows = [i for i in active for _ in beams[i].live]
            prefix = torch.tensor(
                [t for i in active for _, t in beams[i].live], device=src_x.device
            )
            logits = decoder.decode_logits(src_x[rows], src_pad[rows], prefix)[:, -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            start = 0
            for i in active:
                count = len(beams[i].live)
                beams[i] = _advance(
                    beams[i], logprobs[start : start + count], beam_size, eos_id, length_penalty
                )
                start += count
    results = []
    for b in beams:
        pool = b.done + [(s / _length_penalty(len(t) - 1, length_penalty), t) for s, t in b.live]
        results.append(trim_tokens(max(pool, key=lambda item: item[0])[1][1:], eos_id, pad_id))
    return results


def is_pipe(model: nn.Module) -> bool:
    """Whether ``model`` is a pipe whose stages decode with caches (it has ``partitions``)."""
    return hasattr(model, "partitions")


def _positions(pipe: nn.Module) -> int:
    """The position table's size, read where stage 0 is (its child 0, the embedding)."""
    partitions: list[nn.Module] = getattr(pipe, "partitions", None) or [pipe]  # plain: 1 stage
    embedding = next(iter(partitions[0].children()))
    positions = getattr(embedding, "max_len", None)
    if positions is None:
        raise TypeError(
            f"decoding through a pipe needs child 0 to tell its max_len (e.g. "
            f"models.transformer's SourceTargetEmbedding); {type(embedding).__name__} does not"
        )
    return int(positions)


def pipelined_decode(
    pipe: nn.Module,
    src_tokens: Tensor | None,
    *,
    beam_size: int = 1,
    length_penalty: float = 0.6,
    max_len: int | None = None,
    bos_id: int = 2,
    eos_id: int = 3,
    pad_id: int = 0,
) -> list[list[int]]:
    """:func:`greedy_decode` (``beam_size=1``) or :func:`beam_search` through a pipe's stages
    (or a plain model's children, one stage), each keeping the key/value caches of its layers,
    the rows cut into ``pipe.chunks`` micro-batches that follow each other through the stages.
    Token for token the reference's output (the same stopping rules, length penalty and
    ``max_len`` default). Under torchrun every rank of the pipeline calls it (``src_tokens`` is
    read where stage 0 is) and gets the result.

    Example::

        pipe = GPipe(model, balance=[3, 3], devices=["cpu", "cpu"], chunks=2)
        hyps = pipelined_decode(pipe, batch.src_tokens, beam_size=4)   # == beam_search(model, ..)
    """
    prompts, steps = None, []
    if src_tokens is not None and getattr(pipe, "needs_inputs", True):
        wanted = max_len if max_len is not None else int(1.5 * src_tokens.shape[1]) + 10
        limit = max(1, min(wanted, _positions(pipe) - 1))
        chunks = split_rows(src_tokens, int(getattr(pipe, "chunks", 1)))
        prompts = [(s, torch.full((s.shape[0], 1), bos_id, dtype=s.dtype)) for s in chunks]
        steps = [limit] * len(prompts)
    decoding = Decoding(beam_size, length_penalty, eos_id=eos_id, pad_id=pad_id)
    out = generate(pipe, prompts, steps, decoding, timeout=float(getattr(pipe, "timeout", 300.0)))
    return [row for chunk in out for row in chunk]
