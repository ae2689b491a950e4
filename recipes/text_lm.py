"""A tiny Llama on a folder of .txt files (``data=text``): write a generated corpus, or report a
run's held-out perplexity against the unigram baseline.

Command:    python recipes/text_lm.py --generate corpus                      (a second)
            python train.py recipe=llama_text 'data.files=[corpus/*.txt]' hydra.run.dir=outputs/text
            python recipes/text_lm.py --report outputs/text
Hardware:   2 CPU cores; K=2 CPU stand-in devices, M=4 micro-batches (about 2-4 minutes).
Reproduces: held-out perplexity well below the unigram baseline (the model learns the grammar's
            word order and agreement, which token frequencies alone cannot). The measured numbers
            are in results/text/README.md.

``--generate DIR`` writes ``DIR/part_NN.txt``: paragraphs (one document each, blank-line
separated) of English-like sentences from a small grammar, each paragraph about one topic (its
nouns and verbs drawn from that topic's words), deterministic from ``--seed``. Any folder of your
own .txt files works the same way in the second command.

``--report RUN_DIR`` reads ``summary.json`` (eval/loss, the mean held-out cross-entropy per token)
and ``text_data.json`` (the split and the unigram baseline the data builder wrote) and prints::

    held-out perplexity 5.21 (exp of eval/loss 1.651); unigram baseline 38.4; 7.4x lower
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

TOPICS = {
    "farm": (["farmer", "horse", "cow", "field", "barn", "goat"], ["feeds", "sees", "leads"]),
    "sea": (["sailor", "boat", "fish", "wave", "harbor", "gull"], ["watches", "finds", "pulls"]),
    "town": (["baker", "child", "teacher", "shop", "street", "dog"], ["meets", "helps", "likes"]),
    "wood": (["hunter", "fox", "owl", "tree", "river", "bear"], ["follows", "hears", "fears"]),
}
ADJECTIVES = ["old", "small", "quiet", "brave", "tired", "happy", "red", "clever"]
PLACES = ["near the hill", "by the road", "at dawn", "in the rain", "after dinner", "every day"]
PLURALS = {"fish": "fish", "child": "children", "fox": "foxes", "goat": "goats"}
NAMES = ["Anna", "Tomas", "Lina", "Omar", "Nora", "Ivan"]


def noun_phrase(nouns: list[str], rng: random.Random) -> tuple[str, bool]:
    """(phrase, plural): a name, or ``the [adjective] noun(s)``."""
    if rng.random() < 0.2:
        return rng.choice(NAMES), False
    plural = rng.random() < 0.4
    noun = rng.choice(nouns)
    noun = PLURALS.get(noun, noun + "s") if plural else noun
    adjective = f"{rng.choice(ADJECTIVES)} " if rng.random() < 0.5 else ""
    return f"the {adjective}{noun}", plural


def sentence(topic: str, rng: random.Random) -> str:
    """Subject, verb agreeing with it in number, object, sometimes a place: ``The old horse
    sees the goats near the hill.``"""
    nouns, verbs = TOPICS[topic]
    subject, plural = noun_phrase(nouns, rng)
    verb = rng.choice(verbs)
    verb = verb.removesuffix("es" if verb.endswith(("ches", "shes")) else "s") if plural else verb
    obj, _ = noun_phrase(nouns, rng)
    place = f" {rng.choice(PLACES)}" if rng.random() < 0.3 else ""
    return f"{subject[0].upper()}{subject[1:]} {verb} {obj}{place}."


def write_corpus(out_dir: str | Path, documents: int = 600, files: int = 4, seed: int = 0) -> Path:
    """``files`` .txt files holding ``documents`` paragraphs of 3-8 sentences in all.

    Example::

        write_corpus("corpus", documents=200)     # corpus/part_00.txt ... part_03.txt
    """
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paragraphs: list[list[str]] = [[] for _ in range(files)]
    for index in range(documents):
        topic = rng.choice(sorted(TOPICS))
        text = " ".join(sentence(topic, rng) for _ in range(rng.randint(3, 8)))
        paragraphs[index % files].append(text)
    for number, part in enumerate(paragraphs):
        (out / f"part_{number:02d}.txt").write_text("\n\n".join(part) + "\n", encoding="utf-8")
    return out


def report(run_dir: Path) -> str:
    """The perplexity line of a finished ``data=text`` run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    facts = json.loads((run_dir / "text_data.json").read_text())
    loss, baseline = float(summary["eval/loss"]), float(facts["unigram_perplexity"])
    perplexity = math.exp(loss)
    return (
        f"held-out perplexity {perplexity:.2f} (exp of eval/loss {loss:.3f}); unigram baseline "
        f"{baseline:.1f}; {baseline / perplexity:.1f}x lower"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--generate", metavar="DIR", help="write a generated corpus of .txt files")
    group.add_argument("--report", metavar="RUN_DIR", help="print a data=text run's perplexity")
    parser.add_argument("--documents", type=int, default=600, help="paragraphs to generate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.generate:
        out = write_corpus(args.generate, documents=args.documents, seed=args.seed)
        print(f"wrote {len(list(out.glob('*.txt')))} files of {args.documents} paragraphs to {out}")
        return 0
    run_dir = Path(args.report)
    try:
        print(report(run_dir))
    except (OSError, KeyError, ValueError) as err:
        print(f"error: {run_dir}: not a finished data=text run ({err})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
