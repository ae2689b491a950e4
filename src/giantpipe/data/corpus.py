"""Parallel corpora as files: reading yours, with errors that name the file and the line, and
writing the generated multilingual one.

**Reading** (:func:`load_parallel_corpus`): TSV with a header line, JSON Lines or parquet files of
(source, target, language pair) rows into ``{pair: [(source, target), ...]}``. TSV and JSON Lines
are read line by line, so every problem is one :class:`CorpusError` naming the file, the line and
what was expected: a line with the wrong number of fields (lost or extra tabs), a header-only or
empty file, an empty source or target, a pair that is not ``src-tgt``, text that is not UTF-8.
Parquet problems name the row. Blank lines are skipped; fields are taken verbatim (no quoting).

**Generating** (:func:`write_synthetic_corpus`): artificial languages sharing one hidden grammar.
Every sentence is first drawn as a meaning from one grammar,

    S  -> NP_subj V NP_obj [PP]          NP -> name | [adj] noun (singular or plural)
    V  carries tense (present / past) and agrees with the subject's number
    PP -> preposition NP

and then rendered by each language's own rules: vocabulary (pseudo-words built from that
language's syllables), word order (SVO / SOV / VSO ...), adjective before or after the noun,
prepositions or postpositions, articles or none, and suffix morphology (plural, past tense,
subject agreement on the verb, accusative case). The English-like pivot "en" is SVO with
"the", "-s" plurals and irregular pasts. Names are shared by all languages, so copying the
source is a weak but non-zero baseline. Pairs are en->xx and xx->en with sizes that differ per
language (the last languages are low-resource). Everything is deterministic from the seed.

Example::

    files = write_synthetic_corpus("outputs/synth", seed=0)       # train/valid/test .tsv
    corpus = load_parallel_corpus([files["train"]])                 # {"en-xa": [(src, tgt)], ...}
    load_parallel_corpus(["bad.tsv"])
    # CorpusError: bad.tsv, line 7: 2 tab-separated fields, expected 3 as in the header
    # (source, target, pair)
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CorpusError",
    "Language",
    "load_parallel_corpus",
    "make_languages",
    "sample_meaning",
    "split_pair",
    "write_synthetic_corpus",
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


# --------------------------------------------------------------------------------------------
# Reading: one (where, row) per sentence pair, where = "line N" or "row N".
# --------------------------------------------------------------------------------------------

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


def _jsonl_rows(path: Path, needed: Sequence[str]) -> Rows:
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


def _parquet_rows(path: Path, needed: Sequence[str]) -> Rows:
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
        return _jsonl_rows(path, needed)
    if path.suffix == ".parquet":
        return _parquet_rows(path, needed)
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


# --------------------------------------------------------------------------------------------
# Generating: the multilingual corpus of the quick start and the tests.
# --------------------------------------------------------------------------------------------

NAMES = ["Maria", "Tomas", "Anna", "Leo", "Sofia", "Ivan", "Nora", "Omar", "Lina", "Paul"]
NOUNS = {  # concept -> English singular, plural
    "dog": ("dog", "dogs"), "cat": ("cat", "cats"), "bird": ("bird", "birds"),
    "child": ("child", "children"), "woman": ("woman", "women"), "man": ("man", "men"),
    "farmer": ("farmer", "farmers"), "teacher": ("teacher", "teachers"),
    "horse": ("horse", "horses"), "fish": ("fish", "fish"), "king": ("king", "kings"),
    "apple": ("apple", "apples"), "book": ("book", "books"), "house": ("house", "houses"),
    "river": ("river", "rivers"), "tree": ("tree", "trees"), "stone": ("stone", "stones"),
    "bread": ("bread", "breads"), "boat": ("boat", "boats"), "song": ("song", "songs"),
}  # fmt: skip
VERBS = {  # concept -> English 3rd-person singular, plain, past
    "see": ("sees", "see", "saw"), "eat": ("eats", "eat", "ate"),
    "like": ("likes", "like", "liked"), "find": ("finds", "find", "found"),
    "carry": ("carries", "carry", "carried"), "take": ("takes", "take", "took"),
    "build": ("builds", "build", "built"), "watch": ("watches", "watch", "watched"),
    "help": ("helps", "help", "helped"), "follow": ("follows", "follow", "followed"),
    "sell": ("sells", "sell", "sold"), "draw": ("draws", "draw", "drew"),
}  # fmt: skip
ADJECTIVES = ["big", "small", "red", "old", "young", "happy", "quiet", "green", "fast", "tired"]
PREPOSITIONS = ["near", "in", "under", "behind", "with"]
ORDERS = ["SOV", "VSO", "SVO", "OSV", "VOS", "OVS"]
ONSETS = ["p", "t", "k", "m", "n", "s", "l", "r", "b", "d", "g", "v", "z", "h", "f", "j"]
VOWELS = ["a", "e", "i", "o", "u"]


@dataclass(frozen=True)
class NounPhrase:
    head: str  # a NOUNS concept or a name from NAMES
    plural: bool
    adjective: str | None


@dataclass(frozen=True)
class Meaning:
    subject: NounPhrase
    verb: str
    past: bool
    obj: NounPhrase
    place: tuple[str, NounPhrase] | None


@dataclass(frozen=True)
class Language:
    """One artificial language: a lexicon plus the rules that render a ``Meaning``."""

    code: str
    lexicon: dict[str, str]
    order: str  # "SVO", "SOV", "VSO", ...
    adjective_after: bool
    postpositions: bool
    article: str | None
    plural_suffix: str
    past_suffix: str
    agreement_suffix: str  # on the verb when the subject is plural
    accusative_suffix: str  # on the object's head noun ("" = no case)

    def noun_phrase(self, np: NounPhrase, accusative: bool = False) -> list[str]:
        if np.head in NAMES:
            return [np.head + (self.accusative_suffix if accusative else "")]
        noun = self.lexicon[np.head] + (self.plural_suffix if np.plural else "")
        noun += self.accusative_suffix if accusative else ""
        words = [noun] if np.adjective is None else [self.lexicon[np.adjective]]
        if np.adjective is not None:
            words = [words[0], noun] if not self.adjective_after else [noun, words[0]]
        return ([self.article] if self.article else []) + words

    def render(self, m: Meaning) -> str:
        verb = self.lexicon[m.verb] + (self.past_suffix if m.past else "")
        verb += self.agreement_suffix if m.subject.plural else ""
        parts = {"S": self.noun_phrase(m.subject), "V": [verb], "O": self.noun_phrase(m.obj, True)}
        words = [w for slot in self.order for w in parts[slot]]
        if m.place is not None:
            prep, np = self.lexicon[m.place[0]], self.noun_phrase(m.place[1])
            words += np + [prep] if self.postpositions else [prep] + np
        return " ".join(words) + " ."


def render_english(m: Meaning) -> str:
    """The English-like pivot: SVO, "the", irregular plurals and pasts, 3sg "-s"."""

    def np(phrase: NounPhrase) -> list[str]:
        if phrase.head in NAMES:
            return [phrase.head]
        adj = [phrase.adjective] if phrase.adjective else []
        return ["the", *adj, NOUNS[phrase.head][1 if phrase.plural else 0]]

    third_sg, plain, past = VERBS[m.verb]
    verb = past if m.past else (plain if m.subject.plural else third_sg)
    words = np(m.subject) + [verb] + np(m.obj)
    if m.place is not None:
        words += [m.place[0], *np(m.place[1])]
    return " ".join(words) + " ."


def _pseudo_words(rng: random.Random, count: int, syllables: list[str]) -> list[str]:
    words: list[str] = []
    while len(words) < count:
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
        if word not in words and len(word) > 2:
            words.append(word)
    return words


def make_languages(count: int, seed: int = 0) -> list[Language]:
    """``count`` artificial languages ("xa", "xb", ...) with distinct orders and morphology."""
    concepts = list(NOUNS) + list(VERBS) + ADJECTIVES + PREPOSITIONS
    languages = []
    for index in range(count):
        rng = random.Random(seed * 1000 + index)
        onsets = rng.sample(ONSETS, 8)
        syllables = [c + v for c in onsets for v in rng.sample(VOWELS, 3)]
        words = _pseudo_words(rng, len(concepts), syllables)
        suffixes = rng.sample(syllables, 5)  # one syllable each: 4 suffixes and an article
        code = "x" + "abcdefghijklmnopqrstuvwyz"[index]
        languages.append(
            Language(
                code=code,
                lexicon=dict(zip(concepts, words, strict=True)),
                order=ORDERS[index % len(ORDERS)],
                adjective_after=index % 2 == 0,
                postpositions=ORDERS[index % len(ORDERS)].endswith("V"),
                article=suffixes[4] if index % 3 == 2 else None,
                plural_suffix=suffixes[0],
                past_suffix=suffixes[1],
                agreement_suffix=suffixes[2] if index % 2 == 0 else "",
                accusative_suffix=suffixes[3] if index % 3 != 1 else "",
            )
        )
    return languages


def _noun_phrase(rng: random.Random, allow_name: bool = True) -> NounPhrase:
    if allow_name and rng.random() < 0.2:
        return NounPhrase(rng.choice(NAMES), plural=False, adjective=None)
    adjective = rng.choice(ADJECTIVES) if rng.random() < 0.4 else None
    return NounPhrase(rng.choice(list(NOUNS)), plural=rng.random() < 0.4, adjective=adjective)


def sample_meaning(rng: random.Random) -> Meaning:
    """One sentence meaning from the hidden grammar."""
    place = (rng.choice(PREPOSITIONS), _noun_phrase(rng, False)) if rng.random() < 0.3 else None
    return Meaning(
        subject=_noun_phrase(rng),
        verb=rng.choice(list(VERBS)),
        past=rng.random() < 0.5,
        obj=_noun_phrase(rng),
        place=place,
    )


def _pair_rows(
    lang: Language, n: int, rng: random.Random, exclude: set[Meaning]
) -> tuple[list[tuple[str, str, str]], set[Meaning]]:
    """``n`` (source, target, pair) rows alternating en->xx and xx->en, and their meanings."""
    rows: list[tuple[str, str, str]] = []
    meanings: set[Meaning] = set()
    while len(rows) < n:
        meaning = sample_meaning(rng)
        if meaning in exclude:
            continue
        meanings.add(meaning)
        english, other = render_english(meaning), lang.render(meaning)
        if len(rows) % 2 == 0:
            rows.append((english, other, f"en-{lang.code}"))
        else:
            rows.append((other, english, f"{lang.code}-en"))
    return rows, meanings


def _write(path: Path, rows: list[tuple[str, str, str]], fmt: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        if fmt == "tsv":
            f.write("source\ttarget\tpair\n")
            f.writelines(f"{s}\t{t}\t{p}\n" for s, t, p in rows)
        else:
            for s, t, p in rows:
                f.write(json.dumps({"source": s, "target": t, "pair": p}) + "\n")


def write_synthetic_corpus(
    out_dir: str | Path,
    *,
    num_languages: int = 3,
    train_sizes: list[int] | None = None,
    eval_size: int = 100,
    seed: int = 0,
    fmt: str = "tsv",
) -> dict[str, Path]:
    """Write train/valid/test files (``fmt`` "tsv" or "jsonl"); returns {split: path}.

    ``train_sizes[i]`` sentences (half en->xx, half xx->en) for language i; the default
    halves from 8000 down, so the last languages are low-resource. Valid and test hold
    ``eval_size`` sentences per direction, never seen in training.
    """
    if fmt not in ("tsv", "jsonl"):
        raise ValueError(f"fmt must be 'tsv' or 'jsonl', got {fmt!r}")
    sizes = train_sizes or [8000 // 4**i for i in range(num_languages)]
    if len(sizes) != num_languages:
        raise ValueError(f"train_sizes has {len(sizes)} entries for {num_languages} languages")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    languages = make_languages(num_languages, seed)
    splits: dict[str, list[tuple[str, str, str]]] = {"valid": [], "test": [], "train": []}
    for lang, size in zip(languages, sizes, strict=True):
        seen: set[Meaning] = set()
        for split in ("valid", "test"):
            rng = random.Random(f"{seed}-{lang.code}-{split}")
            rows, meanings = _pair_rows(lang, 2 * eval_size, rng, seen)
            splits[split] += rows
            seen |= meanings
        rng = random.Random(f"{seed}-{lang.code}-train")
        splits["train"] += _pair_rows(lang, size, rng, seen)[0]
    paths = {}
    for split, rows in splits.items():
        paths[split] = out / f"{split}.{fmt}"
        _write(paths[split], rows, fmt)
    return paths
