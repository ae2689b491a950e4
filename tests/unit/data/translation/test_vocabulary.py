"""The shared SentencePiece vocabulary: round trips, language tokens kept whole, reused."""

from __future__ import annotations

from pathlib import Path

from giantpipe.data.translation.vocabulary import SharedVocabulary


def test_sentencepiece_round_trip_keeps_language_tokens(corpus, vocab, tmp_path: Path) -> None:
    text = "the big dogs saw Anna near the river ."
    assert vocab.decode(vocab.encode(text)) == text
    ids = vocab.encode("<2xb> " + text)
    assert vocab.lang_id("xb") in ids and vocab.sp.id_to_piece(vocab.lang_id("xb")) == "<2xb>"
    assert (vocab.pad_id, vocab.bos_id, vocab.eos_id) == (0, 2, 3)
    assert vocab.decode([vocab.bos_id, *vocab.encode(text), vocab.eos_id, 0]) == text
    mtime = vocab.model_file.stat().st_mtime_ns
    reused = SharedVocabulary.train_or_load(corpus, vocab.model_file.parent, vocab_size=300)
    assert reused.model_file.stat().st_mtime_ns == mtime
    assert reused.encode(text) == vocab.encode(text)
