"""Text files as documents: every format, one document per paragraph, line or row, each knowing
where it came from."""

from __future__ import annotations

from pathlib import Path

from giantpipe.data.text.bundle import read_text_corpus
from giantpipe.data.text.files import read_documents


def test_every_format_is_read_one_document_per_paragraph_line_or_row(tmp_path: Path) -> None:
    import datasets

    (tmp_path / "a.txt").write_text("first para\nstill first\n\n\nsecond para\n")
    (tmp_path / "b.jsonl").write_text('{"body": "a json doc"}\n\n{"body": "another"}\n')
    datasets.Dataset.from_dict({"body": ["parquet row"]}).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_dict({"body": ["saved 1", "saved 2"]}).save_to_disk(str(tmp_path / "ds"))
    corpus = read_text_corpus(
        [str(tmp_path / "*.*"), str(tmp_path / "ds")],
        seq_len=4,
        vocab_size=40,
        text_field="body",
        valid_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    assert (corpus.documents, corpus.held_out) == (7, 1)
    docs = [d.text for d in read_documents([tmp_path / "a.txt"], "text", "paragraph")]
    assert docs == ["first para\nstill first", "second para"]
    wheres = [d.where for d in read_documents([tmp_path / "a.txt"], "text", "line")]
    assert wheres == [f"{tmp_path / 'a.txt'}, line {n}" for n in (1, 2, 5)]
