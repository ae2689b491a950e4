"""The generated multilingual corpus: deterministic, languages that differ, held-out sentences."""

from __future__ import annotations

from pathlib import Path

from giantpipe.data.translation.files import load_parallel_corpus
from giantpipe.data.translation.generated import make_languages, write_synthetic_corpus


def test_synthetic_corpus_is_deterministic_and_varied(corpus_files, tmp_path: Path) -> None:
    again = write_synthetic_corpus(
        tmp_path, num_languages=3, train_sizes=[800, 200, 40], eval_size=20
    )
    for split in ("train", "valid", "test"):
        assert again[split].read_bytes() == corpus_files[split].read_bytes()
    languages = make_languages(3)
    assert len({lang.order for lang in languages}) == 3
    assert len({lang.lexicon["dog"] for lang in languages}) == 3
    train = load_parallel_corpus([corpus_files["train"]])
    test = load_parallel_corpus([corpus_files["test"]])
    assert len(train["en-xa"]) == 400 and len(train["en-xc"]) == 20  # a low-resource pair
    for pair, rows in test.items():
        assert not set(rows) & set(train[pair])  # held-out sentences
