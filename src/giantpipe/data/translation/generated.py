"""The generated multilingual corpus: artificial languages sharing one hidden grammar, written as
train / valid / test files (the quick start's and the tests' parallel text).

Every sentence is drawn as a meaning from one grammar and rendered by each language's own
rules, deterministically from the seed (docs/your-data.md#translation).

Example::

    from giantpipe.data.translation.generated import write_synthetic_corpus

    files = write_synthetic_corpus("outputs/synth", seed=0)       # train/valid/test .tsv
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Language",
    "make_languages",
    "sample_meaning",
    "write_synthetic_corpus",
]


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
