"""Parallel corpus files as a user brings them: TSV, JSONL and parquet read the same; each problem
(malformed, header-only, not UTF-8, unknown format, a bad language pair) is one line naming the
file, the line and what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from giantpipe.data.translation.files import load_parallel_corpus, split_pair
from giantpipe.data.translation.generated import write_synthetic_corpus


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.tsv"
    with pytest.raises(FileNotFoundError, match="nowhere.tsv.*provide"):
        load_parallel_corpus([missing])


def test_tsv_jsonl_and_parquet_load_the_same(corpus_files, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_synthetic_corpus(
        tmp_path, num_languages=3, train_sizes=[800, 200, 40], eval_size=20, fmt="jsonl"
    )["test"]
    rows = [json.loads(line) for line in jsonl.open()]
    parquet = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    from_tsv = load_parallel_corpus([corpus_files["test"]])
    assert load_parallel_corpus([jsonl]) == from_tsv == load_parallel_corpus([parquet])
    assert sorted(from_tsv) == ["en-xa", "en-xb", "en-xc", "xa-en", "xb-en", "xc-en"]
    assert all(len(v) == 20 for v in from_tsv.values())


def test_missing_field_and_pair_override(tmp_path: Path) -> None:
    path = tmp_path / "two.tsv"
    path.write_text('src\ttgt\nhe said "no\t007\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1: the header \[.src., .tgt.\] lacks"):
        load_parallel_corpus([path])
    loaded = load_parallel_corpus([path], source_field="src", target_field="tgt", pair="en-de")
    assert loaded == {"en-de": [('he said "no', "007")]}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", ": empty; expected a tab-separated header line naming the columns source, target, "
         "pair"),
        ("src\ttgt\npair\n", ", line 1: the header ['src', 'tgt'] lacks ['source', 'target', "
         "'pair']"),
        ("source\ttarget\tpair\nhallo\tw\xc3\n", ", line 2: not UTF-8 text"),
    ],
)  # fmt: skip
def test_tsv_file_problems_name_the_file_and_line(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "train.tsv"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as err:
        load_parallel_corpus([path])
    assert str(err.value).startswith(f"{path}{problem}")


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"source": "a .", "target": "b ."\n', "line 2: not JSON (Expecting ',' delimiter); "
         "expected one JSON object per line with the fields source, target, pair"),
        ('{"source": "a .", "pair": "en-xa"}\n', "line 2: no field ['target']"),
        ('["a .", "b .", "en-xa"]\n', "line 2: a JSON list; expected one JSON object per line"),
        ('{"source": "a .", "target": 7, "pair": "en-xa"}\n', "line 2: field 'target' is 7; "
         "expected text"),
    ],
)  # fmt: skip
def test_jsonl_problems_name_the_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "train.jsonl"
    good = json.dumps({"source": "a .", "target": "b .", "pair": "en-xa"})
    path.write_text(good + "\n" + line, encoding="utf-8")
    with pytest.raises(ValueError) as err:
        load_parallel_corpus([path])
    assert str(err.value).startswith(f"{path}, {problem}")


def test_parquet_problems_name_the_row(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    rows = [{"source": "a .", "target": "b .", "pair": "en-xa"}] * 2
    pq.write_table(pa.Table.from_pylist([*rows, {"source": "c .", "target": "", "pair": "en-xa"}]),
                   path)  # fmt: skip
    with pytest.raises(ValueError, match=r"train\.parquet, row 3: empty 'target'"):
        load_parallel_corpus([path])
    pq.write_table(pa.Table.from_pylist([{"source": "a ."}]), path)
    with pytest.raises(ValueError, match=r"train\.parquet: no column \['target', 'pair'\]"):
        load_parallel_corpus([path])


def test_an_unknown_format_names_the_ones_read(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("source,target,pair\n")
    with pytest.raises(ValueError, match=r"unknown format '\.csv'; expected \.tsv .*\.jsonl"):
        load_parallel_corpus([path])


@pytest.mark.parametrize("pair", ["en-de", "en-sr_Latn", "pt_BR-en"])
def test_language_pairs_split_at_the_first_hyphen(pair: str) -> None:
    assert "-".join(split_pair(pair)) == pair


@pytest.mark.parametrize("pair", ["", "ende", "-de", "en-", "en de", "en -de"])
def test_malformed_language_pairs_are_refused(pair: str) -> None:
    with pytest.raises(ValueError, match="language pair must look like 'en-de'"):
        split_pair(pair)
