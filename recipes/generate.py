"""Generate with a trained run: cached decoding through the pipeline (giantpipe.engine.generate).

Command:     python recipes/generate.py RUN --prompt "12 7 9"                 # token ids
             python recipes/generate.py RUN/step_200 --text "the old farmer"  # data=text: words
             python recipes/generate.py RUN --text "the dog ." --to xa        # transformer_t
             torchrun --nproc_per_node=2 recipes/generate.py RUN --prompt "12 7 9"
Hardware:    CPU (or a GPU: --device cuda); --stages K cuts the model into K stages, one worker
             thread each, and the prompts into --chunks M micro-batches that follow each other.
             Under torchrun: one stage per process (K = world size), each rank building and
             loading only its own layers (DistributedPipe); rank 0 prints.
Reproduces:  the greedy (or --beam N, or --temperature T sampled) continuation of each prompt,
             one line per prompt; the same tokens whatever K and M (greedy and beam).

RUN is a run directory (its last/ checkpoint is used), or any checkpoint the runner wrote
(RUN/last, RUN/step_N), or a state_dict file; the model is rebuilt from RUN/config.yaml
(``model._target_``: a flat Sequential whose children offer forward_cached, such as
models.transformer's transformer_t and transformer_lm, or a model the runner captured with
sequentialize, such as model=hf_causal_lm's Llama or GPT-2, captured here the same way). A
language model's ``--prompt`` is token ids; ``--text`` is words, for a run that kept a tokenizer
(``data=text``: its SentencePiece model in RUN/, or ``data.tokenizer``), encoded, continued up
to the tokenizer's end of text and decoded back to words. A translation model's prompt is text
in the run's SentencePiece vocabulary (RUN/spm.model, or data.vocab_dir), translated into --to.
Prompts of any lengths share the --chunks micro-batches (each row decodes as its prompt alone).

Bad input (a missing or damaged checkpoint, a model that cannot generate, an empty prompt, ids
that are not ids or lie outside the vocabulary, --max-new below 1, ...) is one line naming it on
stderr, ``error: ...``, and exit status 2; the arguments and the run's config.yaml are checked
before torch is imported (a fraction of a second), the rest once the model is built
(``generation_run.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

LAST = "last"
"""The checkpoint of a run directory that generate.py uses (the runner's latest save)."""


def fail(message: str) -> NoReturn:
    """Bad input: one line on stderr and exit status 2 (as train.py's refusals)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def checkpoint_of(given: Path) -> Path:
    """The checkpoint ``given`` names: a run directory (it holds config.yaml) means its last/."""
    if not given.exists():
        fail(f"{given}: no such run or checkpoint (give RUN, RUN/last, RUN/step_N or a "
             "state_dict file)")  # fmt: skip
    if not (given.is_dir() and (given / "config.yaml").is_file()):
        return given
    if (given / LAST).exists():
        return given / LAST
    kept = sorted(given.glob("step_*"), key=lambda p: (len(p.name), p.name))
    hint = f"give one of its checkpoints, e.g. {kept[-1]}" if kept else "it saved none"
    fail(f"{given}: the run has no {LAST}/ checkpoint ({hint})")


def read_config(checkpoint: Path) -> dict[str, Any]:
    """The run's resolved config (config.yaml beside the checkpoint)."""
    config_file = checkpoint.parent / "config.yaml"
    if not config_file.is_file():
        fail(f"no config.yaml beside {checkpoint}: the run's model cannot be rebuilt")
    try:
        cfg = yaml.safe_load(config_file.read_text())
    except (OSError, yaml.YAMLError) as err:
        fail(f"{config_file}: not a readable config ({' '.join(str(err).split())[:160]})")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        fail(f"{config_file}: no model (model._target_) to rebuild")
    return cfg


def check_run(args: argparse.Namespace, cfg: dict[str, Any]) -> None:
    """What the config alone tells: a translation model needs --to; words need a text run."""
    seq2seq = str(cfg["model"].get("_target_", "")).endswith("transformer_t")
    if seq2seq and args.to is None:  # an encoder-decoder: models.transformer.EncoderDecoder
        fail("a translation model needs --to LANG (the target language)")
    data = str((cfg.get("data") or {}).get("_target_", "its data"))
    if args.text and not seq2seq and not data.endswith("text.bundle.text"):
        fail(f"--text: this run ({data}) kept no tokenizer; give --prompt with token ids")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, every value checked: one line naming the bad one, exit 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", type=Path, help="RUN (its last/), RUN/last, RUN/step_N or a state_dict file"
    )
    parser.add_argument("--prompt", action="append", help="token ids; repeat for several")
    parser.add_argument("--text", action="append", help="words (a run with a tokenizer)")
    parser.add_argument("--to", help="target language of a translation model (e.g. xa)")
    parser.add_argument("--max-new", type=int, default=32, help="tokens per LM continuation")
    parser.add_argument("--beam", type=int, default=1, help="beam size (translation)")
    parser.add_argument("--length-penalty", type=float, default=0.6)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (LM)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stages", type=int, default=1, help="K: pipeline stages")
    parser.add_argument("--chunks", type=int, default=1, help="M: micro-batches")
    parser.add_argument("--device", default="cpu", help="device of every stage")
    args = parser.parse_args(argv)
    if not args.prompt and not args.text:
        fail('give --prompt "IDS" (token ids) or --text "WORDS" (a run with a tokenizer)')
    if args.prompt and args.text:
        fail("give --prompt (token ids) or --text (words), not both")
    for flag, value in (("--prompt", args.prompt), ("--text", args.text)):
        for given in value or []:
            if not given.strip():
                fail(f"{flag} {given!r} is empty: give at least one token")
    for flag, value in (("--max-new", args.max_new), ("--beam", args.beam),
                        ("--stages", args.stages), ("--chunks", args.chunks)):  # fmt: skip
        if value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    if args.temperature < 0:
        fail(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        fail(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        fail(f"--top-p must be in (0, 1], got {args.top_p}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    checkpoint = checkpoint_of(args.checkpoint)
    cfg = read_config(checkpoint)
    check_run(args, cfg)
    from generation_run import BadInput, generated_lines  # torch: once the arguments hold

    try:
        lines = generated_lines(args, checkpoint, cfg)
    except BadInput as err:
        fail(str(err))
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
