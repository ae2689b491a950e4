"""Held-out BLEU for the translation data: greedy and beam decoding, sacreBLEU per language pair.

Decoding needs no engine and no import of the model's code: it reaches the model only through
what the model object offers (:class:`Seq2Seq`: ``encode`` once per batch, ``decode_logits`` once
per generated position on the whole prefix, ``max_len``), as ``models.transformer``'s
``EncoderDecoder`` does. No key/value cache: decoding stays exact and simple at O(T^2) cost;
it is the reference. A pipe (``GPipe`` or ``DistributedPipe``) decodes through its stages with
each stage's key/value caches instead (:func:`pipelined_decode`, :mod:`giantpipe.engine.generate`),
token for token as the reference does, with no whole copy of the model anywhere.
:class:`HeldOutBleu` is the translation bundle's ``evaluate_model``.

Example::

    report = evaluate_bleu(model, vocab, test_corpus, beam_size=4)
    report.per_pair["en-xa"], report.average, report.signature, report.tokens_per_second
    copy_baseline_bleu(test_corpus).average        # BLEU of echoing the source
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from sacrebleu.metrics import BLEU
from torch import Tensor, nn

from giantpipe.data.bundle import EvaluationError
from giantpipe.data.corpus import split_pair
from giantpipe.data.translation import SharedVocabulary, eval_batches
from giantpipe.engine.generate import Decoding, generate, split_rows
from giantpipe.engine.generate.search import trim_tokens

__all__ = [
    "Seq2Seq",
    "greedy_decode",
    "beam_search",
    "pipelined_decode",
    "corpus_bleu",
    "BleuReport",
    "evaluate_bleu",
    "copy_baseline_bleu",
    "HeldOutBleu",
]

log = logging.getLogger(__name__)

Corpus = Mapping[str, Sequence[tuple[str, str]]]  # {pair: [(source, reference)]}


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
    was_training = model.training
    model.eval()
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
    model.train(was_training)
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
    was_training = model.training
    model.eval()
    decoder = seq2seq(model)
    src_x, src_pad = decoder.encode(src_tokens)
    beams = [_Beams([(0.0, [bos_id])]) for _ in range(src_tokens.shape[0])]
    for _ in range(_max_steps(decoder, src_tokens, max_len)):
        active = [i for i, b in enumerate(beams) if len(b.done) < beam_size and b.live]
        if not active:
            break
        rows = [i for i in active for _ in beams[i].live]
        prefix = torch.tensor([t for i in active for _, t in beams[i].live], device=src_x.device)
        logits = decoder.decode_logits(src_x[rows], src_pad[rows], prefix)[:, -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        start = 0
        for i in active:
            count = len(beams[i].live)
            beams[i] = _advance(
                beams[i], logprobs[start : start + count], beam_size, eos_id, length_penalty
            )
            start += count
    model.train(was_training)
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


def corpus_bleu(
    hypotheses: Sequence[str], references: Sequence[str], force: bool = False
) -> tuple[float, str]:
    """(sacreBLEU corpus score, its signature string) with the default 13a tokenizer.

    ``force`` silences sacreBLEU's warning about text that looks tokenized (the generated
    corpus is written with spaces before punctuation); the score is the same either way.
    """
    bleu = BLEU(force=force)
    score = bleu.corpus_score(list(hypotheses), [list(references)]).score
    return float(score), str(bleu.get_signature())


@dataclass
class BleuReport:
    """BLEU per language pair and their unweighted mean; decoding speed when a model ran."""

    per_pair: dict[str, float]
    average: float
    signature: str
    hypotheses: dict[str, list[str]]
    tokens_per_second: float | None = None
    generated_tokens: int = 0


def _score(
    hypotheses: dict[str, list[str]], corpus: Corpus, force: bool = False
) -> tuple[dict[str, float], float, str]:
    per_pair: dict[str, float] = {}
    signature = ""
    for pair in sorted(hypotheses):
        refs = [t for _, t in corpus[pair]]
        per_pair[pair], signature = corpus_bleu(hypotheses[pair], refs, force)
    average = sum(per_pair.values()) / len(per_pair) if per_pair else math.nan
    return per_pair, average, signature


def _translate_pair(
    model: nn.Module,
    vocab: SharedVocabulary,
    examples: Sequence[tuple[str, str]],
    pair: str,
    beam_size: int,
    max_tokens: int,
    length_penalty: float,
    max_source_len: int | None = None,
) -> tuple[list[str], int]:
    """Hypotheses for one pair, in the order of ``examples``, and the generated token count.

    A source longer than ``max_source_len`` tokens (with its markers) is cut to its first ones:
    the model has no positions for more; its reference stays whole.
    """
    lang = vocab.lang_id(split_pair(pair)[1])
    device = next(model.parameters()).device
    piped = is_pipe(model)
    keep = None if max_source_len is None else max(max_source_len - 2, 1)
    encoded = [
        ([lang, *vocab.encode(s)[:keep], vocab.eos_id], vocab.encode(t)) for s, t in examples
    ]
    hyps: list[str] = [""] * len(examples)
    generated = 0
    for indices, batch in eval_batches(encoded, pair, max_tokens):
        if piped:  # stage 0 takes the tokens to its device
            out = pipelined_decode(
                model, batch.src_tokens, beam_size=beam_size, length_penalty=length_penalty
            )
        elif beam_size == 1:
            out = greedy_decode(model, batch.src_tokens.to(device))
        else:
            src = batch.src_tokens.to(device)
            out = beam_search(model, src, beam_size=beam_size, length_penalty=length_penalty)
        for index, ids in zip(indices, out, strict=True):
            hyps[index] = vocab.decode(ids)
            generated += len(ids) + 1  # the tokens plus </s>
    return hyps, generated


def evaluate_bleu(
    model: nn.Module,
    vocab: SharedVocabulary,
    corpus: Corpus,
    *,
    beam_size: int = 1,
    max_tokens: int = 4096,
    length_penalty: float = 0.6,
    force: bool = False,
    max_source_len: int | None = None,
) -> BleuReport:
    """Translate every pair of ``corpus`` ({pair: [(source, reference)]}) and score it.

    ``tokens_per_second`` counts generated target tokens (with </s>) over decoding wall time;
    sources longer than ``max_source_len`` tokens are cut (see :func:`_translate_pair`).

    Example::

        report = evaluate_bleu(model, vocab, load_parallel_corpus(["test.tsv"]), beam_size=4)
        print(report.average, report.signature)
    """
    hypotheses: dict[str, list[str]] = {}
    generated, start = 0, time.perf_counter()
    for pair in sorted(corpus):
        hyps, count = _translate_pair(
            model, vocab, corpus[pair], pair, beam_size, max_tokens, length_penalty, max_source_len
        )
        hypotheses[pair], generated = hyps, generated + count
    elapsed = time.perf_counter() - start
    per_pair, average, signature = _score(hypotheses, corpus, force)
    speed = generated / elapsed if elapsed > 0 else math.inf
    return BleuReport(per_pair, average, signature, hypotheses, speed, generated)


def copy_baseline_bleu(corpus: Corpus, force: bool = False) -> BleuReport:
    """BLEU of the trivial system that outputs its source unchanged (a floor to beat).

    Example::

        copy_baseline_bleu({"xa-en": [("Anna hanu .", "Anna sees the dog .")]}).average
    """
    hypotheses = {pair: [s for s, _ in examples] for pair, examples in corpus.items()}
    per_pair, average, signature = _score(hypotheses, corpus, force)
    return BleuReport(per_pair, average, signature, hypotheses)


class HeldOutBleu:
    """``evaluate_model`` of the bundle: decode held-out sentences, score them with sacreBLEU.

    Returns ``bleu`` (unweighted mean over the pairs seen in training), ``bleu/<pair>``,
    ``bleu_copy`` (BLEU of echoing the source: a floor to beat), ``decode_tokens_per_s`` and
    ``bleu_signature``; pairs in ``zero_shot`` (never seen in training) are reported apart, as
    ``bleu_zero_shot/<pair>`` and their mean ``bleu_zero_shot``, never in ``bleu``. A failure
    is an :class:`~giantpipe.data.bundle.EvaluationError` naming ``eval_set``.

    Given a pipe (``takes_pipe``: the runner hands it the pipe, not a whole model) it decodes
    through the stages with their caches; under torchrun every rank of the pipeline calls it.

    Example::

        scorer = HeldOutBleu(vocab, {"en-xa": [("the dog .", "hanu .")]}, beam_size=1)
        scorer(model)["bleu/en-xa"]
        scorer(pipe)["bleu/en-xa"]                 # the same figure, decoded stage by stage
    """

    takes_pipe = True
    config_key = "data.bleu_sentences"  # what asked for it, if the model cannot generate

    def __init__(
        self,
        vocab: SharedVocabulary,
        corpus: Mapping[str, Sequence[tuple[str, str]]],
        beam_size: int,
        length_penalty: float = 0.6,
        max_tokens: int = 4096,
        force: bool = False,
        *,
        max_source_len: int | None = None,
        zero_shot: frozenset[str] = frozenset(),
        eval_set: str = "the held-out sentences",
    ) -> None:
        self.vocab, self.corpus, self.force = vocab, dict(corpus), force
        self.beam_size, self.length_penalty, self.max_tokens = beam_size, length_penalty, max_tokens
        self.max_source_len, self.zero_shot, self.eval_set = max_source_len, zero_shot, eval_set
        seen = {p: rows for p, rows in self.corpus.items() if p not in zero_shot}
        copy = copy_baseline_bleu(seen, force)
        self.copy_bleu = copy.average
        shown = ", ".join(f"{p} {b:.1f}" for p, b in copy.per_pair.items())
        log.info("copy-the-source baseline BLEU %.2f (%s)", copy.average, shown)

    def __call__(self, model: nn.Module) -> dict[str, float | str]:
        try:
            report = evaluate_bleu(
                model,
                self.vocab,
                self.corpus,
                beam_size=self.beam_size,
                max_tokens=self.max_tokens,
                length_penalty=self.length_penalty,
                force=self.force,
                max_source_len=self.max_source_len,
            )
        except Exception as err:  # noqa: BLE001 - any failure: say which set was decoded
            raise EvaluationError(self.eval_set, f"BLEU decoding failed: {err}") from err
        seen = {p: b for p, b in report.per_pair.items() if p not in self.zero_shot}
        unseen = {p: b for p, b in report.per_pair.items() if p in self.zero_shot}
        figures: dict[str, float | str] = {"bleu": _mean(seen.values())}
        figures.update({f"bleu/{pair}": score for pair, score in seen.items()})
        if unseen:
            figures["bleu_zero_shot"] = _mean(unseen.values())
            figures.update({f"bleu_zero_shot/{pair}": score for pair, score in unseen.items()})
        figures["bleu_copy"] = self.copy_bleu
        figures["decode_tokens_per_s"] = report.tokens_per_second or 0.0
        figures["bleu_signature"] = report.signature
        return figures


def _mean(values: Iterable[float]) -> float:
    listed = list(values)
    return sum(listed) / len(listed) if listed else math.nan
