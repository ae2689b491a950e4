"""Shared by the text tests: the generated grammar corpus."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.scripts import load_script

torch.set_num_threads(1)
write_corpus = load_script("recipes/text_lm.py").write_corpus


@pytest.fixture(scope="package")
def corpus(tmp_path_factory) -> Path:
    """The generated grammar corpus: 4 .txt files, 300 paragraphs."""
    return write_corpus(tmp_path_factory.mktemp("text") / "corpus", documents=300, seed=0)
