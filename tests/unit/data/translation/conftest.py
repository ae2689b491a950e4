"""Shared by the translation tests: a generated corpus of three languages, its shared vocabulary
and the encoded sentence pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.data.translation.files import load_parallel_corpus
from giantpipe.data.translation.generated import write_synthetic_corpus
from giantpipe.data.translation.vocabulary import SharedVocabulary, encode_corpus

torch.set_num_threads(1)


@pytest.fixture(scope="package")
def corpus_files(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("synthetic")
    return write_synthetic_corpus(out, num_languages=3, train_sizes=[800, 200, 40], eval_size=20)


@pytest.fixture(scope="package")
def corpus(corpus_files):
    return load_parallel_corpus([corpus_files["train"]])


@pytest.fixture(scope="package")
def vocab(corpus, tmp_path_factory) -> SharedVocabulary:
    return SharedVocabulary.train_or_load(corpus, tmp_path_factory.mktemp("spm"), vocab_size=300)


@pytest.fixture(scope="package")
def encoded(corpus, vocab):
    return encode_corpus(corpus, vocab)
