"""Real-format parallel corpora through the ``data=translation`` bundle: malformed held-out and
header-only training files, over-long lines and a pair never trained. Each problem is one line
naming the key, the file, the line and what was expected; long held-out lines and zero-shot pairs
never fail."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from giantpipe.config import ConfigError
from giantpipe.data.bundle import EvaluationError
from giantpipe.data.translation.bundle import translation
from giantpipe.data.translation.generated import write_synthetic_corpus
from models.transformer import transformer_t

torch.set_num_threads(1)


HEADER = "source\ttarget\tpair\n"
HEADER = "source\ttarget\tpair\n"
SMALL = dict(vocab_size=200, max_len=48, max_tokens=512, bleu_sentences=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Two languages besides English, both directions: xa high-resource, xb low-resource."""
    out = tmp_path_factory.mktemp("corpus")
    return write_synthetic_corpus(out, num_languages=2, train_sizes=[400, 80], eval_size=6)


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spm")


def build(corpus: dict[str, Path], spm_dir: Path, valid: Path, **extra):
    """The bundle of the generated training file and ``valid`` (the vocabulary trained once)."""
    files = dict(train_files=[str(corpus["train"])], valid_files=[str(valid)])
    return translation(**files, **{**SMALL, **extra}, vocab_dir=str(spm_dir), run_dir=spm_dir)


def with_lines(corpus: dict[str, Path], path: Path, *lines: str) -> Path:
    """``path``: the first valid sentences of the generated corpus, then ``lines``."""
    kept = corpus["valid"].read_text(encoding="utf-8").splitlines(keepends=True)[:9]
    path.write_text("".join(kept) + "".join(lines), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("a .\tb .\ten-xa\textra\n", "line 11: 4 tab-separated field(s), expected 3 as in the "
         "header (source, target, pair)"),
        ("a . b . en-xa\n", "line 11: 1 tab-separated field(s), expected 3 as in the header"),
        ("a .\tb .\n", "line 11: 2 tab-separated field(s), expected 3 as in the header"),
        ("a .\t\ten-xa\n", "line 11: empty 'target'; expected a sentence on every line"),
        ("a .\tb .\tenxa\n", "line 11: language pair 'enxa' in field 'pair'; expected "
         "source-target language codes such as 'en-de'"),
    ],
)  # fmt: skip
def test_a_bad_held_out_line_is_one_line_naming_key_file_and_line(
    corpus, spm_dir, tmp_path: Path, line: str, problem: str
) -> None:
    valid = with_lines(corpus, tmp_path / "valid.tsv", "\n", line)  # a blank line is skipped
    with pytest.raises(ConfigError) as err:
        build(corpus, spm_dir, valid)
    assert str(err.value).startswith(f"data.valid_files: {valid}, {problem}")
    assert "\n" not in str(err.value)


def test_a_header_only_training_file_says_it_holds_no_pairs(tmp_path: Path) -> None:
    train, valid = tmp_path / "train.tsv", tmp_path / "valid.tsv"
    train.write_text(HEADER)
    valid.write_text(HEADER + "a .\tb .\ten-xa\n")
    with pytest.raises(ConfigError) as err:
        translation([str(train)], [str(valid)], run_dir=tmp_path)
    assert str(err.value) == (
        f"data.train_files: {train}: no sentence pairs after its header line; expected one per line"
    )


def long_line(words: int = 60) -> str:
    return " ".join(["the big dog"] * (words // 3)) + " .\t" + "hanu " * 60 + ".\ten-xa\n"


def test_long_held_out_lines_leave_the_eval_loss_and_are_cut_for_bleu(
    corpus, spm_dir, tmp_path: Path, caplog
) -> None:
    valid = with_lines(corpus, tmp_path / "valid.tsv", long_line(), long_line(90))
    with caplog.at_level(logging.WARNING, logger="giantpipe.data.translation.bundle"):
        bundle = build(corpus, spm_dir, valid, bleu_sentences=None)
    assert f"held-out ({valid}): 2 of 10 sentence pairs are longer than data.max_len=48" in (
        caplog.text
    )
    longest = max(max(src.shape[1], out.shape[1]) for (src, _), out in bundle.eval_batches())
    assert longest <= SMALL["max_len"]
    # The model has max_len positions: the long sources used to fail inside its encoder.
    torch.manual_seed(0)
    model = transformer_t(1, 16, 2, d_model=8, head_dim=4, vocab_size=200, max_len=48)
    assert bundle.evaluate_model is not None
    figures = bundle.evaluate_model(model)
    assert 0.0 <= float(figures["bleu/en-xa"]) <= 100.0


def test_long_training_lines_are_left_out_and_counted(corpus, spm_dir, tmp_path, caplog) -> None:
    train = tmp_path / "train.tsv"
    train.write_text(corpus["train"].read_text() + long_line(), encoding="utf-8")
    files = dict(train_files=[str(train)], valid_files=[str(corpus["valid"])])
    with caplog.at_level(logging.WARNING, logger="giantpipe.data.translation.bundle"):
        translation(**files, **SMALL, vocab_dir=str(spm_dir), run_dir=tmp_path)
    assert "training: 1 of 481 sentence pairs are longer than data.max_len=48" in caplog.text


def test_an_evaluation_failure_names_the_held_out_files(corpus, spm_dir) -> None:
    bundle = build(corpus, spm_dir, corpus["valid"])
    assert bundle.evaluate_model is not None and bundle.eval_set == str(corpus["valid"])
    with pytest.raises(EvaluationError) as err:
        bundle.evaluate_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))  # no encode/decode
    assert str(err.value).startswith(f"evaluation on {corpus['valid']}: BLEU decoding failed")


def test_a_held_out_pair_never_trained_is_refused_naming_it(corpus, spm_dir, tmp_path) -> None:
    valid = with_lines(corpus, tmp_path / "valid.tsv", "hanu .\tpolo .\txa-xb\n")
    with pytest.raises(ConfigError) as err:
        build(corpus, spm_dir, valid)
    assert str(err.value) == (
        f"data.valid_files: {valid}: pair 'xa-xb' never appears in data.train_files (trained: "
        "en-xa, en-xb, xa-en, xb-en); remove it, or set data.zero_shot=true to evaluate it "
        "zero-shot, reported as eval/bleu_zero_shot apart from eval/bleu"
    )


def test_zero_shot_pairs_are_reported_apart_from_the_average(corpus, spm_dir, tmp_path) -> None:
    valid = with_lines(corpus, tmp_path / "valid.tsv", "hanu .\tpolo .\txa-xb\n")
    bundle = build(corpus, spm_dir, valid, zero_shot=True)
    torch.manual_seed(0)
    model = transformer_t(1, 16, 2, d_model=8, head_dim=4, vocab_size=200, max_len=48)
    assert bundle.evaluate_model is not None
    figures = bundle.evaluate_model(model)
    seen = [float(v) for k, v in figures.items() if k.startswith("bleu/")]
    assert "bleu/xa-xb" not in figures and "bleu_zero_shot/xa-xb" in figures
    assert figures["bleu_zero_shot"] == figures["bleu_zero_shot/xa-xb"]
    assert figures["bleu"] == pytest.approx(sum(seen) / len(seen))
    # The eval loss reads only trained pairs: en-xa (<2xa> ...) and xa-en (<2en> ...).
    first = {int(src[0, 0]) for (src, _), _ in bundle.eval_batches()}
    assert len(first) == 2


def test_a_target_language_never_trained_is_refused_even_zero_shot(corpus, spm_dir, tmp_path):
    valid = with_lines(corpus, tmp_path / "valid.tsv", "the dog .\tder Hund .\ten-de\n")
    with pytest.raises(ConfigError) as err:
        build(corpus, spm_dir, valid, zero_shot=True)
    assert str(err.value).startswith(
        f"data.valid_files: {valid}: pair 'en-de' translates into 'de', a language no file of "
        "data.train_files holds, so the vocabulary has no <2de> token"
    )
