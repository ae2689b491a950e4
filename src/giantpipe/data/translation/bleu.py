"""Held-out BLEU for the translation data: hypotheses decoded and scored with sacreBLEU per
language pair, against the copy-the-source floor.

Decoding is :mod:`giantpipe.data.translation.decoding`'s (a whole model's reference decoders,
or a pipe's stages with their caches). :class:`HeldOutBleu` is the translation bundle's
``evaluate_model``.

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
from dataclasses import dataclass

from sacrebleu.metrics import BLEU
from torch import nn

from giantpipe.data.bundle import EvaluationError
from giantpipe.data.translation.batches import eval_batches
from giantpipe.data.translation.decoding import (
    beam_search,
    greedy_decode,
    is_pipe,
    pipelined_decode,
)
from giantpipe.data.translation.files import split_pair
from giantpipe.data.translation.vocabulary import SharedVocabulary
from giantpipe.engine.inference import PipedModel

__all__ = [
    "BleuReport",
    "HeldOutBleu",
    "copy_baseline_bleu",
    "corpus_bleu",
    "evaluate_bleu",
]


log = logging.getLogger(__name__)


Corpus = Mapping[str, Sequence[tuple[str, str]]]  # {pair: [(source, reference)]}


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

    Given the pipe as its whole model (a :class:`~giantpipe.engine.inference.PipedModel`, as
    the runner hands it on every rank) or a pipe, it decodes through the stages with their
    caches; given a whole plain model, with the reference decoders.

    Example::

        scorer = HeldOutBleu(vocab, {"en-xa": [("the dog .", "hanu .")]}, beam_size=1)
        scorer(model)["bleu/en-xa"]
        scorer(PipedModel(pipe))["bleu/en-xa"]     # the same figure, decoded stage by stage
    """

    generates = True  # it decodes: the model's children must keep key/value caches
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

    def __call__(self, model: PipedModel | nn.Module) -> dict[str, float | str]:
        try:
            report = evaluate_bleu(
                model.pipe if isinstance(model, PipedModel) else model,
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
