"""Parallel corpora as files: yours read into ``{pair: [(source, target)]}``, every problem one
error that names the file, the line and what was expected.

:func:`load_parallel_corpus` reads TSV with a header, JSON Lines or parquet, line by line, so a
bad line is one :class:`CorpusError` (docs/your-data.md#a-parallel-corpus).

Example::

    from giantpipe.data.translation.files import load_parallel_corpus

    corpus = load_parallel_corpus(["train.tsv"])                 # {"en-xa": [(src, tgt)], ...}
    load_parallel_corpus(["bad.tsv"])
    # CorpusError: bad.tsv, line 7: 2 tab-separated fields, expected 3 as in the header
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = [
    "Corpus",
    "CorpusError",
    "jsonl_rows",
    "load_parallel_corpus",
    "parquet_rows",
    "split_pair",
]


Corpus = dict[str, list[tuple[str, str]]]
FORMATS = (".tsv", ".jsonl", ".json", ".parquet")
_PAIR = re.compile(r"[^\s-]+-\S+")


class CorpusError(ValueError):
    """A corpus file that cannot be read as parallel text: the message starts with the file and,
    where there is one, the line (``train.tsv, line 7: ...``) or parquet row."""


def split_pair(pair: str) -> tuple[str, str]:
    """``"en-xa"`` -> ``("en", "xa")``; a ValueError for anything not ``src-tgt``.

    Example::

        split_pair("en-sr_Latn")          # ("en", "sr_Latn")
    """
    if not isinstance(pair, str) or not _PAIR.fullmatch(pair):
        raise ValueError(f"language pair must look like 'en-de', got {pair!r}")
    src, _, tgt = pair.partition("-")
    return src, tgt


Rows = Iterator[tuple[str, dict[str, object]]]


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line, without the line end (and a leading BOM)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                where = f"{path}, line {number}"
                problem = f"not UTF-8 text ({err.reason} at byte {err.start})"
                raise CorpusError(f"{where}: {problem}") from None
            if number == 1:
                line = line.removeprefix("\ufeff")
            if line.strip():
                yield number, line


def _tsv_rows(path: Path, needed: Sequence[str]) -> Rows:
    lines = _text_lines(path)
    first = next(lines, None)
    expected = f"a tab-separated header line naming the columns {', '.join(needed)}"
    if first is None:
        raise CorpusError(f"{path}: empty; expected {expected}, then one sentence pair per line")
    number, line = first
    header = line.split("\t")
    missing = [name for name in needed if name not in header]
    if missing:
        raise CorpusError(
            f"{path}, line {number}: the header {header} lacks {missing}; expected {expected} "
            "(does the file lack its header line?)"
        )
    for number, line in lines:
        fields = line.split("\t")
        if len(fields) != len(header):
            raise CorpusError(
                f"{path}, line {number}: {len(fields)} tab-separated field(s), expected "
                f"{len(header)} as in the header ({', '.join(header)})"
            )
        yield f"line {number}", dict(zip(header, fields, strict=True))


def jsonl_rows(path: Path, needed: Sequence[str]) -> Rows:
    expected = f"one JSON object per line with the fields {', '.join(needed)}"
    for number, line in _text_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            problem = f"not JSON ({err.msg}); expected {expected}"
            raise CorpusError(f"{path}, line {number}: {problem}") from None
        if not isinstance(row, dict):
            kind = type(row).__name__
            raise CorpusError(f"{path}, line {number}: a JSON {kind}; expected {expected}")
        missing = [name for name in needed if name not in row]
        if missing:
            raise CorpusError(f"{path}, line {number}: no field {missing}; expected {expected}")
        yield f"line {number}", row


def parquet_rows(path: Path, needed: Sequence[str]) -> Rows:
    import pyarrow.parquet as pq  # a dependency of datasets; only needed for parquet files

    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise CorpusError(f"{path}: not a readable parquet file ({err})") from err
    missing = [name for name in needed if name not in table.column_names]
    if missing:
        raise CorpusError(
            f"{path}: no column {missing} (found {table.column_names}); expected the columns "
            f"{', '.join(needed)}"
        )
    columns = {name: table.column(name).to_pylist() for name in needed}
    for index in range(table.num_rows):
        yield f"row {index + 1}", {name: columns[name][index] for name in needed}


def _rows(path: Path, needed: Sequence[str]) -> Rows:
    if not path.is_file():
        raise FileNotFoundError(
            f"parallel corpus not found: {path} (provide a .tsv/.jsonl/.parquet file with "
            f"{', '.join(repr(n) for n in needed)} fields)"
        )
    if path.suffix == ".tsv":
        return _tsv_rows(path, needed)
    if path.suffix in (".jsonl", ".json"):
        return jsonl_rows(path, needed)
    if path.suffix == ".parquet":
        return parquet_rows(path, needed)
    raise CorpusError(
        f"{path}: unknown format {path.suffix!r}; expected .tsv (with a header line), .jsonl "
        "(JSON Lines) or .parquet"
    )


def _sentence(row: dict[str, object], name: str, where: str) -> str:
    value = row[name]
    if not isinstance(value, str):
        raise CorpusError(f"{where}: field {name!r} is {value!r}; expected text")
    if not value.strip():
        raise CorpusError(f"{where}: empty {name!r}; expected a sentence on every line")
    return value


def load_parallel_corpus(
    paths: Sequence[str | Path],
    *,
    source_field: str = "source",
    target_field: str = "target",
    pair_field: str = "pair",
    pair: str | None = None,
) -> Corpus:
    """Read TSV (with a header line), JSON Lines or parquet files into ``{pair: [(source,
    target)]}``, in file order. Each row needs the source, target and language-pair fields;
    ``pair`` instead names the pair of every row of these files. A problem is a
    :class:`CorpusError` naming the file and the line; a missing file a FileNotFoundError.

    Example::

        corpus = load_parallel_corpus(["data/train.tsv"])
        corpus["en-xa"][0]  # ('the dog sees Anna .', 'Anna-po hanu ...')
    """
    if pair is not None:
        split_pair(pair)
    needed = [source_field, target_field] + ([] if pair else [pair_field])
    corpus: Corpus = {}
    for raw in paths:
        path = Path(raw)
        count = 0
        for where, row in _rows(path, needed):
            located = f"{path}, {where}"
            name = pair or row[pair_field]
            try:
                split_pair(name)  # type: ignore[arg-type]
            except ValueError:
                raise CorpusError(
                    f"{located}: language pair {name!r} in field {pair_field!r}; expected "
                    "source-target language codes such as 'en-de'"
                ) from None
            src, tgt = _sentence(row, source_field, located), _sentence(row, target_field, located)
            corpus.setdefault(name, []).append((src, tgt))  # type: ignore[arg-type]
            count += 1
        if count == 0:
            after = " after its header line" if path.suffix == ".tsv" else ""
            raise CorpusError(f"{path}: no sentence pairs{after}; expected one per line")
    return corpus
