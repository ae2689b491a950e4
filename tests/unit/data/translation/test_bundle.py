"""The ``data=translation`` bundle: what the runner relies on."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch

from giantpipe.config import ConfigError
from giantpipe.data.bundle import DataBundle
from giantpipe.data.translation.bundle import eval_groups, translation
from models.transformer import transformer_t

SMALL = dict(
    generated_languages=2,
    generated_train_sizes=[600, 120],
    generated_eval_size=12,
    vocab_size=300,
    max_len=48,
    max_tokens=256,
    min_sentences=4,
    bleu_sentences=5,
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def bundle(run_dir: Path) -> DataBundle:
    return translation(**SMALL, run_dir=run_dir)


def same(a, b) -> bool:
    (xa, ya), (xb, yb) = a, b
    return all(torch.equal(p, q) for p, q in zip((*xa, ya), (*xb, yb)))


def test_training_batches_are_a_pure_function_of_seed_and_position(bundle: DataBundle) -> None:
    first = list(itertools.islice(bundle.train_batches(3, 0), 12))
    resumed = list(itertools.islice(bundle.train_batches(3, 7), 5))
    assert all(same(a, b) for a, b in zip(first[7:], resumed))
    again = list(itertools.islice(bundle.train_batches(3, 0), 12))
    assert all(same(a, b) for a, b in zip(first, again))
    other = list(itertools.islice(bundle.train_batches(4, 0), 12))
    assert not all(same(a, b) for a, b in zip(first, other))


def test_batches_are_token_bounded_padded_and_vary_in_shape(bundle: DataBundle) -> None:
    shapes = set()
    for (src, tgt_in), tgt_out in itertools.islice(bundle.train_batches(0, 0), 30):
        assert src.dtype == tgt_in.dtype == tgt_out.dtype == torch.long
        assert tgt_in.shape == tgt_out.shape and src.shape[0] == tgt_out.shape[0]
        assert src.shape[0] >= SMALL["min_sentences"]  # one sentence per micro-batch at least
        assert src.shape[0] * max(src.shape[1], tgt_in.shape[1]) <= SMALL["max_tokens"]
        shifted = tgt_out[:, :-1].masked_fill(tgt_out[:, :-1].eq(3), 0)  # y </s> -> y
        assert torch.equal(tgt_in[:, 1:], shifted) and tgt_in[:, 0].eq(2).all()  # <s> y
        shapes.add((src.shape, tgt_out.shape))
    assert len(shapes) > 5


def test_loss_normalizer_and_tokens_count_non_pad_targets(bundle: DataBundle) -> None:
    (src, tgt_in), tgt_out = next(bundle.train_batches(0, 0))
    real = int(tgt_out.ne(0).sum())
    assert 0 < real <= tgt_out.numel()
    assert bundle.loss_normalizer is not None and bundle.loss_normalizer(tgt_out) == real
    assert bundle.tokens_per_batch is not None
    assert bundle.tokens_per_batch(((src, tgt_in), tgt_out)) == real
    assert bundle.ignore_index == 0 and bundle.loss == "cross_entropy"


def test_eval_batches_hold_every_held_out_sentence(bundle: DataBundle) -> None:
    batches = list(bundle.eval_batches())
    sentences = sum(int(t.shape[0]) for _, t in batches)
    assert sentences == 2 * 2 * SMALL["generated_eval_size"]  # 2 languages, both directions
    assert all(t.shape[0] >= SMALL["min_sentences"] for _, t in batches)
    # Pairs take turns, so trainer.eval_batches=4 sees en-xa, en-xb, xa-en, xb-en.
    first_tokens = {int(src[0, 0]) for (src, _), _ in batches[:4]}  # <2xa>, <2xb>, <2en>
    assert len(first_tokens) == 3


@pytest.mark.parametrize("minimum", [1, 2, 3])
def test_eval_groups_keep_every_index_and_the_minimum(minimum: int) -> None:
    sizes = [5, 3, 9, 4, 12, 2, 7]
    groups = eval_groups(sizes, max_tokens=12, min_sentences=minimum)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert all(len(g) >= minimum for g in groups)


def test_held_out_bleu_reports_pairs_average_copy_and_signature(bundle: DataBundle) -> None:
    torch.manual_seed(0)
    model = transformer_t(1, 32, 2, d_model=16, head_dim=8, vocab_size=300, max_len=64)
    assert bundle.evaluate_model is not None
    figures = bundle.evaluate_model(model)
    pairs = {k for k in figures if k.startswith("bleu/")}
    assert pairs == {"bleu/en-xa", "bleu/xa-en", "bleu/en-xb", "bleu/xb-en"}
    assert 0.0 <= float(figures["bleu"]) <= 100.0 and float(figures["bleu_copy"]) >= 0.0
    assert float(figures["decode_tokens_per_s"]) > 0
    assert "version:" in str(figures["bleu_signature"])
    assert model.training  # decoding restores the mode


def test_vocabulary_is_reused_when_present(run_dir: Path, bundle: DataBundle, caplog) -> None:
    model_file = run_dir / "spm.model"
    before = (model_file.read_bytes(), model_file.stat().st_mtime_ns)
    with caplog.at_level(logging.INFO, logger="giantpipe.data.translation.bundle"):
        translation(**SMALL, run_dir=run_dir)
    assert (model_file.read_bytes(), model_file.stat().st_mtime_ns) == before
    assert "vocabulary: reusing" in caplog.text


def test_a_vocabulary_larger_than_the_model_output_is_rejected(run_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data\.vocab_size: .*spm\.model holds"):
        translation(**{**SMALL, "vocab_size": 20}, run_dir=run_dir)


@pytest.mark.parametrize("key", ["train_files", "valid_files"])
def test_missing_files_name_the_key_the_path_and_the_quickstart(key: str, tmp_path: Path) -> None:
    files = {"train_files": [str(tmp_path / "train.tsv")], "valid_files": [str(tmp_path / "v.tsv")]}
    if key == "valid_files":
        (tmp_path / "train.tsv").write_text("source\ttarget\tpair\na .\tb .\ten-xa\n")
    with pytest.raises(ConfigError) as err:
        translation(**files, run_dir=tmp_path)
    message = str(err.value)
    assert message.startswith(f"data.{key}: ") and "\n" not in message
    assert files[key][0] in message and "recipe=transformer_quickstart" in message
