"""Text files as documents: the files ``data.files`` globs name, read into documents that know
where they came from; every problem one ConfigError naming ``data.files``, the file and the line.

A ``.txt`` file is one document per paragraph (text between blank lines; or the whole file, or
each line: ``data.txt_documents``), a JSON line, parquet row or saved ``datasets`` row is one.

Example::

    from giantpipe.data.text.files import expand_files, read_documents

    docs = read_documents(expand_files(["corpus/*.txt"]), "text", "paragraph")
    docs[0].where                  # 'corpus/a.txt, line 1'
"""

from __future__ import annotations

import glob
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from giantpipe.config import ConfigError
from giantpipe.data.translation.files import CorpusError, jsonl_rows, parquet_rows

SUFFIXES = (".txt", ".jsonl", ".parquet")
HOW_TO_PROVIDE = (
    "give data.files=[...] globs of .txt, .jsonl (a 'text' field) or .parquet files, or a folder "
    "saved by datasets' save_to_disk"
)


@dataclass
class Document:
    """One document's text and where it came from (``corpus/a.txt, line 3``)."""

    where: str
    text: str


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``)."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json")
    )


def expand_files(patterns: Sequence[str]) -> list[Path]:
    """The files (and saved datasets) the patterns name, sorted within each pattern; a
    ConfigError naming ``data.files`` for an empty list, a pattern matching nothing, or a
    file of another format.

    Example::

        expand_files(["corpus/*.txt", "more/books.jsonl"])
    """
    if not patterns:
        raise ConfigError("data.files", f"no files given; {HOW_TO_PROVIDE}")
    found: list[Path] = []
    for pattern in patterns:
        matches = sorted(
            Path(p) for p in glob.glob(str(Path(pattern).expanduser()), recursive=True)
        )
        if not matches:
            raise ConfigError("data.files", f"{pattern!r} matches no file; {HOW_TO_PROVIDE}")
        for path in matches:
            if is_saved_dataset(path):
                found.append(path)
            elif path.is_dir():
                inside = sorted(p for p in path.rglob("*") if _readable(p, path))
                if not inside:
                    raise ConfigError("data.files", f"{path} holds no {'/'.join(SUFFIXES)} file")
                found += inside
            elif path.suffix not in SUFFIXES:
                raise ConfigError(
                    "data.files", f"{path}: unknown format {path.suffix!r}; {HOW_TO_PROVIDE}"
                )
            else:
                found.append(path)
    return list(dict.fromkeys(found))  # a file two patterns match is read once


def _readable(path: Path, folder: Path) -> bool:
    """A file of a known format in ``folder``, outside hidden folders (the tokenizer cache)."""
    hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
    return path.suffix in SUFFIXES and path.is_file() and not hidden


def _txt_documents(path: Path, mode: str) -> Iterator[Document]:
    """Paragraphs (or the file, or its lines) of a UTF-8 text file; a byte that is not UTF-8
    is a CorpusError naming the file and the line."""
    lines: list[str] = []
    start = 1
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n").removeprefix("\ufeff")
            except UnicodeDecodeError as err:
                problem = f"not UTF-8 text ({err.reason} at byte {err.start})"
                raise CorpusError(f"{path}, line {number}: {problem}") from None
            if line.strip():
                start = start if lines else number
                lines.append(line)
            if lines and (mode == "line" or (mode == "paragraph" and not line.strip())):
                yield Document(f"{path}, line {start}", "\n".join(lines))
                lines = []
    if lines:
        yield Document(f"{path}, line {start}", "\n".join(lines))


def _row_documents(path: Path, text_field: str) -> Iterator[Document]:
    """JSON lines or parquet rows: the ``text_field`` of each, which must be text."""
    reader = parquet_rows if path.suffix == ".parquet" else jsonl_rows
    rows = reader(path, [text_field])
    for where, row in rows:
        value = row[text_field]
        if not isinstance(value, str):
            raise CorpusError(f"{path}, {where}: field {text_field!r} is {value!r}; expected text")
        if value.strip():
            yield Document(f"{path}, {where}", value)


def _dataset_documents(path: Path, text_field: str) -> Iterator[Document]:
    """The rows of a dataset saved with ``save_to_disk`` (a DatasetDict's ``train`` split)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - datasets raises several types for a bad folder
        raise CorpusError(f"{path}: not a readable saved dataset ({err})") from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise CorpusError(f"{path}: a DatasetDict without a 'train' split ({list(loaded)})")
        loaded = loaded["train"]
    if text_field not in loaded.column_names:
        raise CorpusError(
            f"{path}: no column {text_field!r} (found {loaded.column_names}); set data.text_field"
        )
    for index, value in enumerate(loaded[text_field]):
        if not isinstance(value, str):
            raise CorpusError(f"{path}, row {index + 1}: {text_field!r} is {value!r}; not text")
        if value.strip():
            yield Document(f"{path}, row {index + 1}", value)


def read_documents(paths: Sequence[Path], text_field: str, txt_documents: str) -> list[Document]:
    """Every document of ``paths`` in order; a problem is a ConfigError naming ``data.files``,
    the file and the line (or row).

    Example::

        docs = read_documents([Path("corpus/a.txt")], "text", "paragraph")
        docs[0].where                  # 'corpus/a.txt, line 1'
    """
    documents: list[Document] = []
    for path in paths:
        try:
            if is_saved_dataset(path):
                part = list(_dataset_documents(path, text_field))
            elif path.suffix == ".txt":
                part = list(_txt_documents(path, txt_documents))
            else:
                part = list(_row_documents(path, text_field))
        except CorpusError as err:
            raise ConfigError("data.files", str(err)) from err
        if not part:
            raise ConfigError("data.files", f"{path}: no text; expected at least one document")
        documents += part
    return documents


def content_hash(paths: Sequence[Path]) -> str:
    """sha256 over the files' bytes (a saved dataset's files too), in order: the cache key."""
    digest = hashlib.sha256()
    for path in paths:
        for part in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if part.is_file():
                digest.update(part.name.encode() + b"\0")
                with part.open("rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
    return digest.hexdigest()
