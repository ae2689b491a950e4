"""The tokenizer: SentencePiece trained once and keyed by the files' content, or a Hugging Face
tokenizer directory checked against data.vocab_size; ids past it decode as unknown."""

from __future__ import annotations

from pathlib import Path

import pytest

from giantpipe.config import ConfigError
from giantpipe.data.text.bundle import read_text_corpus
from tests.support.scripts import load_script

write_corpus = load_script("recipes/text_lm.py").write_corpus


def test_the_tokenizer_is_trained_once_and_keyed_by_the_files_content(tmp_path: Path) -> None:
    data = write_corpus(tmp_path / "c", documents=40)
    cache = data / ".giantpipe_cache"
    read_text_corpus([str(data / "*.txt")], 8, 100)  # cached beside the data by default
    (model,) = cache.glob("*.model")
    stamp = model.stat().st_mtime_ns
    read_text_corpus([str(data / "*.txt")], 8, 100)
    assert [p.stat().st_mtime_ns for p in cache.glob("*.model")] == [stamp]  # reused
    with (data / "part_00.txt").open("a") as f:
        f.write("\nA new paragraph about the river.\n")
    read_text_corpus([str(data / "*.txt")], 8, 100)
    assert len(list(cache.glob("*.model"))) == 2  # other content, another tokenizer


def test_ids_past_the_tokenizer_decode_as_unknown(tmp_path: Path) -> None:
    """A model's output may be wider than its tokenizer (data.vocab_size >= the tokenizer's
    size): what it generates there reads as the unknown piece, not an error."""
    data = write_corpus(tmp_path / "c", documents=40)
    vocab = read_text_corpus([str(data / "*.txt")], 8, 300).vocab
    ids = vocab.encode("the old farmer")
    assert vocab.decode([*ids, vocab.size + 7]) == vocab.decode([*ids, 0])  # 0: <unk>


def test_a_hugging_face_tokenizer_directory(corpus: Path, tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = sorted({w for p in corpus.glob("*.txt") for w in p.read_text().split()})
    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>"
    )
    fast.save_pretrained(str(tmp_path / "tok"))
    c = read_text_corpus([str(corpus / "*.txt")], 8, len(vocab), tokenizer=str(tmp_path / "tok"))
    assert c.vocab.size == len(vocab) and c.vocab.eos_id == 1
    assert c.vocab.decode(c.train_rows[0, :3].tolist()).split()[0] in words
    assert c.vocab.decode([*c.train_rows[0, :3].tolist(), len(vocab) + 2]).endswith("[UNK]")
    with pytest.raises(ConfigError, match=rf"data.vocab_size: is 10, but .* has {len(vocab)} ids"):
        read_text_corpus([str(corpus / "*.txt")], 8, 10, tokenizer=str(tmp_path / "tok"))
