"""The searches, where the logits are: greedy, sampled (temperature, top-k, top-p) and beam
search with GNMT's length penalty, one per micro-batch.

Example::

    >>> import torch
    >>> search = RowSearch(rows=1, steps=2, decoding=Decoding(), m=0)
    >>> tokens, order = search.advance(torch.tensor([[0.0, 5.0, 1.0]]))   # greedy: token 1
    >>> tokens.tolist(), order
    ([[1]], None)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from giantpipe.engine.generate.decoding import Decoding, Message, Tokens

__all__ = ["BeamSearch", "RowSearch", "Search", "Searches", "trim_tokens"]


class Search(Protocol):
    def advance(self, logits: Tensor) -> tuple[Tensor, Tensor | None] | None:
        """Given the logits [rows, V] of this step: (next tokens [rows', 1], order [rows'] or
        None when every row goes on as it is), or None when the micro-batch is done."""
        ...

    def result(self) -> Tokens: ...


def trim_tokens(ids: Sequence[int], eos_id: int | None, pad_id: int | None) -> list[int]:
    """A decoded row as the caller sees it: up to (not including) ``</s>``, padding left out."""
    out = []
    for i in ids:
        if i == eos_id:
            break
        if i != pad_id:
            out.append(int(i))
    return out


def _filtered(logits: Tensor, decoding: Decoding) -> Tensor:
    """Logits / temperature with all but the top-k and the top-p nucleus set to -inf."""
    logits = logits.float() / decoding.temperature
    if decoding.top_k is not None and decoding.top_k < logits.shape[-1]:
        kth = logits.topk(decoding.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if decoding.top_p is not None and decoding.top_p < 1:
        ordered, index = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)
        ordered = ordered.masked_fill(before >= decoding.top_p, float("-inf"))  # keeps the top
        logits = torch.full_like(logits, float("-inf")).scatter(-1, index, ordered)
    return logits


class RowSearch:
    """Greedy or sampled decoding of a micro-batch: one token per row and step; a row that
    chose </s> leaves (its caches are dropped with it)."""

    def __init__(self, rows: int, steps: int, decoding: Decoding, m: int) -> None:
        self.decoding, self.steps = decoding, steps
        self.tokens: Tokens = [[] for _ in range(rows)]
        self.alive = list(range(rows))  # original row of each current row
        self.generator = torch.Generator().manual_seed(decoding.seed + m)

    def _pick(self, logits: Tensor) -> Tensor:
        if self.decoding.temperature == 0:
            return logits.argmax(dim=-1)
        probs = _filtered(logits, self.decoding).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def advance(self, logits: Tensor) -> tuple[Tensor, Tensor | None] | None:
        picked = self._pick(logits.cpu()).tolist()
        keep = []
        for row, token in enumerate(picked):
            self.tokens[self.alive[row]].append(token)
            if token != self.decoding.eos_id:
                keep.append(row)
        every = len(keep) == len(self.alive)
        self.alive = [self.alive[row] for row in keep]
        if not keep or len(self.tokens[self.alive[0]]) >= self.steps:
            return None
        # every row goes on: no order, so that no stage copies its caches for nothing
        return torch.tensor([[picked[row]] for row in keep]), None if every else torch.tensor(keep)

    def result(self) -> Tokens:
        return [trim_tokens(t, self.decoding.eos_id, self.decoding.pad_id) for t in self.tokens]


def _length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha, as the reference decoder's."""
    return ((5.0 + length) / 6.0) ** alpha


@dataclass
class _Beams:
    """One sentence: live (score, tokens, row of its parent) and finished (norm, tokens)."""

    live: list[tuple[float, list[int], int]]
    done: list[tuple[float, list[int]]] = field(default_factory=list)


class BeamSearch:
    """Beam search over a micro-batch with the reference decoder's rules (fairseq's): a
    candidate ending in </s> is kept only if it ranks within the top ``beam_size``; a sentence
    stops once ``beam_size`` hypotheses ended; at ``steps`` the live ones are scored as they are.
    """

    def __init__(self, rows: int, steps: int, decoding: Decoding) -> None:
        self.decoding, self.steps, self.taken = decoding, steps, 0
        self.beams = [_Beams([(0.0, [], row)]) for row in range(rows)]

    def _active(self) -> list[int]:
        size = self.decoding.beam_size
        return [i for i, b in enumerate(self.beams) if len(b.done) < size and b.live]

    def advance(self, logits: Tensor) -> tuple[Tensor, Tensor | None] | None:
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        start = 0
        for i in self._active():  # the rows are the live beams of the active sentences
            count = len(self.beams[i].live)
            self._advance(self.beams[i], logprobs[start : start + count], start)
            start += count
        self.taken += 1
        active = self._active()
        if not active or self.taken >= self.steps:
            return None
        live = [beam for i in active for beam in self.beams[i].live]
        return torch.tensor([[t[-1]] for _, t, _ in live]), torch.tensor([p for _, _, p in live])

    def _advance(self, beams: _Beams, logprobs: Tensor, first_row: int) -> None:
        size, eos, alpha = (
            self.decoding.beam_size,
            self.decoding.eos_id,
            self.decoding.length_penalty,
        )
        scores = torch.tensor([s for s, _, _ in beams.live], dtype=logprobs.dtype)[:, None]
        scores = scores + logprobs
        top, flat = scores.flatten().topk(min(2 * size, scores.numel()))
        vocab = logprobs.shape[1]
        live: list[tuple[float, list[int], int]] = []
        for rank, (score, index) in enumerate(zip(top.tolist(), flat.tolist(), strict=True)):
            parent, token = index // vocab, index % vocab
            tokens = beams.live[parent][1] + [token]
            if token == eos:
                if rank < size and len(beams.done) < size:
                    # the penalty's length counts </s>, not <s> (as the reference's)
                    beams.done.append((score / _length_penalty(len(tokens), alpha), tokens[:-1]))
            elif len(live) < size:
                live.append((score, tokens, first_row + parent))
        beams.live = live

    def result(self) -> Tokens:
        alpha, out = self.decoding.length_penalty, []
        for b in self.beams:
            pool = b.done + [(s / _length_penalty(len(t), alpha), t) for s, t, _ in b.live]
            best = max(pool, key=lambda item: item[0])[1]
            out.append(trim_tokens(best, self.decoding.eos_id, self.decoding.pad_id))
        return out


class Searches:
    """The last stage's searches, one per micro-batch, made when its first logits arrive.

    Example::

        searches = Searches(Decoding(beam_size=4, eos_id=3))
        reply = searches.advance(Message(0, logits, steps=40))  # next tokens, or done
        searches.results[0]
    """

    def __init__(self, decoding: Decoding) -> None:
        self.decoding = decoding
        self.running: dict[int, Search] = {}
        self.results: dict[int, Tokens] = {}

    def advance(self, message: Message) -> Message:
        m, logits = message.m, message.value[:, -1]
        search = self.running.get(m)
        if search is None:
            rows, steps = logits.shape[0], message.steps
            search = (
                BeamSearch(rows, steps, self.decoding)
                if self.decoding.beam_size > 1
                else RowSearch(rows, steps, self.decoding, m)
            )
            self.running[m] = search
        step = search.advance(logits)
        if step is None:
            self.results[m] = self.running.pop(m).result()
            return Message(m, None)
        return Message(m, step[0], step[1])
