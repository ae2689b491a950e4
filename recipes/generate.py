"""Generate with a trained run: cached decoding through the pipeline (giantpipe.engine.generate).

Command:     python recipes/generate.py RUN/last --prompt "12 7 9"            # token ids
             python recipes/generate.py RUN/last --text "the old farmer"      # data=text: words
             python recipes/generate.py RUN/last --text "the dog ." --to xa   # transformer_t
             torchrun --nproc_per_node=2 recipes/generate.py RUN/last --prompt "12 7 9"
Hardware:    CPU (or a GPU: --device cuda); --stages K cuts the model into K stages, one worker
             thread each, and the prompts into --chunks M micro-batches that follow each other.
             Under torchrun: one stage per process (K = world size), each rank building and
             loading only its own layers (DistributedPipe); rank 0 prints.
Reproduces:  the greedy (or --beam N, or --temperature T sampled) continuation of each prompt,
             one line per prompt; the same tokens whatever K and M (greedy and beam).

RUN/last is any checkpoint the runner wrote (or a state_dict file); the model is rebuilt from
RUN/config.yaml (``model._target_``: a flat Sequential whose children offer forward_cached, such
as models.transformer's transformer_t and transformer_lm, or a model the runner captured with
sequentialize, such as model=hf_causal_lm's Llama or GPT-2, captured here the same way). A
language model's ``--prompt`` is token ids; ``--text`` is words, for a run that kept a tokenizer
(``data=text``: its SentencePiece model in RUN/, or ``data.tokenizer``), encoded, continued up
to the tokenizer's end of text and decoded back to words. A translation model's prompt is text
in the run's SentencePiece vocabulary (RUN/spm.model, or data.vocab_dir), translated into --to.
Prompts of any lengths share the --chunks micro-batches (each row decodes as its prompt alone).

Bad input (a missing or damaged checkpoint, a model that cannot generate, an empty prompt, ids
that are not ids or lie outside the vocabulary, --max-new below 1, ...) is one line naming it on
stderr, ``error: ...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

import torch
import yaml
from hydra.utils import instantiate
from torch import nn

from giantpipe import GPipe
from giantpipe.config import ConfigError
from giantpipe.data.translation.decoding import pipelined_decode
from giantpipe.engine.generate import Decoding, generate
from giantpipe.engine.generate.caches import check_cached
from giantpipe.perf.balance import even_balance
from giantpipe.runner.checkpoint.init_from import matching, read_weights
from giantpipe.runner.model import capture


def fail(message: str) -> NoReturn:
    """Bad input: one line on stderr and exit status 2 (as train.py's refusals)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_config(checkpoint: Path) -> dict[str, Any]:
    """The run's resolved config (config.yaml beside the checkpoint)."""
    if not checkpoint.exists():
        fail(f"{checkpoint}: no such checkpoint (give RUN/last, RUN/step_N or a state_dict file)")
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


def build_model(cfg: dict[str, Any]) -> nn.Sequential:
    """The run's model as the flat Sequential its pipe cut: built from the config; a model that
    is not one (model=hf_causal_lm) is captured as the runner captured it, at the run's
    pipeline.split_points, its pieces given their key/value caches. A model whose children
    cannot decode with caches (an image model) is refused by name."""
    model = instantiate_model(cfg)
    if not isinstance(model, nn.Sequential):
        pipeline = cfg.get("pipeline") or {}
        sample = (torch.zeros(2, 8, dtype=torch.long),)  # token ids: a causal LM's input
        try:
            model = capture(model, sample, pipeline.get("split_points"), pipeline.get("output"))
        except ConfigError as err:  # e.g. the run's split points no longer name submodules
            fail(str(err))
        except Exception as err:  # noqa: BLE001 - not a model of token ids (an image model)
            fail(f"this run's model ({cfg['model'].get('_target_')}) cannot generate: it does "
                 f"not take token ids ({type(err).__name__})")  # fmt: skip
    check_generates(model, cfg)
    return model


def instantiate_model(cfg: dict[str, Any]) -> nn.Module:
    """``model._target_`` of the run's config, built; one line when it cannot be."""
    try:
        model: nn.Module = instantiate(cfg["model"])
    except Exception as err:  # noqa: BLE001 - hydra wraps the builder's own error
        reason = " ".join(str(err).split())[:200]
        fail(f"the run's model ({cfg['model'].get('_target_')}) cannot be built: {reason}")
    return model


def check_generates(model: nn.Module, cfg: dict[str, Any]) -> None:
    """Every child decodes with caches (forward_cached), else one line naming the first."""
    try:
        check_cached(list(model.children()))
    except TypeError as err:
        target = cfg["model"].get("_target_")
        fail(f"this run's model ({target}) cannot generate: {err}")


def read_run_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights; a missing or damaged one is one line naming it."""
    try:
        return read_weights(checkpoint)
    except ConfigError as err:  # read_weights speaks as trainer.init_from: not this script's key
        fail(f"{checkpoint}: {err.problem}")


def load_model(checkpoint: Path, cfg: dict[str, Any]) -> nn.Sequential:
    """The run's model (from the config.yaml beside the checkpoint) with the saved weights."""
    model = build_model(cfg)
    weights = read_run_weights(checkpoint)
    live = model.state_dict()
    found = matching(weights, live)
    missing = sorted(set(live) - set(found))
    if missing:
        fail(f"{checkpoint} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    model.load_state_dict(found)
    return model.eval()


def distributed_pipe(checkpoint: Path, cfg: dict, chunks: int) -> tuple[nn.Module, bool]:
    """This rank's stage of the model (built on meta, only its layers allocated and loaded)."""
    import torch.distributed as dist

    from giantpipe.engine.distributed.layout import init_distributed
    from giantpipe.engine.distributed.pipe import DistributedPipe

    init_distributed()
    with torch.device("meta"):  # the children's count only: no weights anywhere
        probe = instantiate_model(cfg)
    if isinstance(probe, nn.Sequential):
        check_generates(probe, cfg)
        layers, build = len(probe), lambda: instantiate(cfg["model"])
    else:  # captured on every rank, as the runner does; each rank then keeps its stage only
        captured = build_model(cfg)
        layers, build = len(captured), lambda: captured
    balance = even_balance(layers, dist.get_world_size())
    pipe = DistributedPipe(build, balance, chunks=chunks, init=None)
    own = pipe.state_dict()
    found = matching(read_run_weights(checkpoint), own)
    if set(found) != set(own):
        fail(f"{checkpoint} lacks tensors of rank {dist.get_rank()}'s stage")
    pipe.load_state_dict(found)
    return pipe.eval(), dist.get_rank() == 0


def run_tokenizer(cfg: dict[str, Any], run_dir: Path) -> Any:
    """The tokenizer a ``data=text`` run kept (``data.tokenizer``, else its SentencePiece model
    in the run directory), as ``giantpipe.data.text.vocabulary.Vocabulary``; None when the run
    has none (token data)."""
    from giantpipe.data.text.vocabulary import Vocabulary

    data = cfg.get("data") or {}
    if not str(data.get("_target_", "")).endswith("text.bundle.text"):
        return None
    given = data.get("tokenizer")
    if given:
        path = Path(given).expanduser()
        path = path if path.exists() or path.is_absolute() else run_dir / given
        if not path.exists():
            fail(f"the run's data.tokenizer {given} is not found (from here or {run_dir})")
    else:
        facts = run_dir / "text_data.json"
        name = Path(json.loads(facts.read_text())["tokenizer"]).name if facts.is_file() else ""
        kept = [run_dir / name] if name else sorted(run_dir.glob("spm-*.model"))
        if not kept or not kept[0].is_file():
            fail(f"{run_dir} keeps no tokenizer (spm-*.model): give --prompt with token ids")
        path = kept[0]
    try:
        return Vocabulary.load(path)
    except (ConfigError, OSError, RuntimeError) as err:
        fail(f"the run's tokenizer {path} cannot be read ({' '.join(str(err).split())[:160]})")


def vocabulary_size(cfg: dict[str, Any], model: nn.Module | None) -> int | None:
    """The model's vocabulary: ``model.vocab_size`` of the config, else its first embedding's."""
    size = cfg["model"].get("vocab_size")
    if isinstance(size, int):
        return size
    tables = [
        m for m in (model.modules() if model is not None else []) if isinstance(m, nn.Embedding)
    ]
    return tables[0].num_embeddings if tables else None


def token_rows(prompts: list[str], vocab: int | None, has_tokenizer: bool) -> list[list[int]]:
    """Each ``--prompt`` as token ids, each checked: ids, and inside the vocabulary."""
    rows = []
    for prompt in prompts:
        try:
            ids = [int(t) for t in prompt.split()]
        except ValueError:
            hint = "; this run has a tokenizer: give words with --text" if has_tokenizer else ""
            fail(f"--prompt {prompt!r} is not token ids (integers separated by spaces){hint}")
        outside = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if outside:
            fail(f"--prompt {prompt!r}: token {outside[0]} is outside the model's vocabulary "
                 f"(0..{vocab - 1 if vocab is not None else 'n'})")  # fmt: skip
        rows.append(ids)
    return rows


def continue_rows(
    pipe: nn.Module, rows: list[list[int]] | None, args: argparse.Namespace, eos: int | None
) -> list[list[int]]:
    """A language model: each row continued; rows of any lengths share the --chunks
    micro-batches (left-padded and masked by the engine). ``rows`` None: a rank without
    stage 0 (it gets the result all the same)."""
    decoding = Decoding(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        eos_id=eos,
    )  # fmt: skip
    count = len(args.prompt or args.text)
    chunks = max(1, min(args.chunks, count))
    bounds = [count * i // chunks for i in range(chunks + 1)]
    batches = None if rows is None else [rows[a:b] for a, b in zip(bounds, bounds[1:])]
    out = generate(pipe, batches, [args.max_new] * chunks, decoding)
    return [ids for chunk in out for ids in chunk]


def translate(
    pipe: nn.Module, prompts: list[str], cfg: dict, args: argparse.Namespace
) -> list[str]:
    """A translation model: each sentence into ``--to``, in the run's vocabulary."""
    from giantpipe.data.translation.vocabulary import SharedVocabulary

    vocab_dir = cfg.get("data", {}).get("vocab_dir") or args.checkpoint.parent
    model_file = Path(vocab_dir) / "spm.model"
    if not model_file.is_file():
        fail(f"{model_file} not found: the run's vocabulary (data.vocab_dir, else RUN/spm.model)")
    vocab = SharedVocabulary(model_file)
    if vocab.lang_id(args.to) == vocab.sp.unk_id():
        pieces = (vocab.sp.id_to_piece(i) for i in range(vocab.vocab_size))
        langs = [p[2:-1] for p in pieces if p.startswith("<2") and p.endswith(">")]
        fail(f"--to {args.to}: not a language of this run (it has {', '.join(langs)})")
    rows = [[vocab.lang_id(args.to), *vocab.encode(p), vocab.eos_id] for p in prompts]
    src = torch.full((len(rows), max(map(len, rows))), vocab.pad_id)
    for i, row in enumerate(rows):
        src[i, : len(row)] = torch.tensor(row)
    hyps = pipelined_decode(pipe, src, beam_size=args.beam, length_penalty=args.length_penalty)
    return [vocab.decode(ids) for ids in hyps]


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, every value checked: one line naming the bad one, exit 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="RUN/last, RUN/step_N or a state_dict file")
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
    cfg = read_config(args.checkpoint)
    seq2seq = str(cfg["model"].get("_target_", "")).endswith("transformer_t")
    prompts: list[str] = args.prompt or args.text
    if seq2seq and args.to is None:  # an encoder-decoder: models.transformer.EncoderDecoder
        fail("a translation model needs --to LANG (the target language)")
    tokenizer = None if seq2seq else run_tokenizer(cfg, args.checkpoint.parent)
    if args.text and not seq2seq and tokenizer is None:
        data = (cfg.get("data") or {}).get("_target_", "its data")
        fail(f"--text: this run ({data}) kept no tokenizer; give --prompt with token ids")
    printing = True
    if "RANK" in os.environ:  # under torchrun: one stage per process
        rows = None if seq2seq else encode(prompts, args, cfg, None, tokenizer)
        pipe, printing = distributed_pipe(args.checkpoint, cfg, args.chunks)
    else:
        model = load_model(args.checkpoint, cfg)
        rows = None if seq2seq else encode(prompts, args, cfg, model, tokenizer)
        pipe = model.to(args.device)
        if args.stages > 1 or args.chunks > 1:
            balance = even_balance(len(model), args.stages)
            pipe = GPipe(model, balance, devices=[args.device] * args.stages, chunks=args.chunks)
    if seq2seq:
        lines = translate(pipe, prompts, cfg, args)
    else:
        words = args.text is not None
        stage0 = getattr(pipe, "needs_inputs", True)
        eos = tokenizer.eos_id if words else None  # words stop at the end of text
        out = continue_rows(pipe, rows if stage0 else None, args, eos)
        lines = [tokenizer.decode(ids).strip() if words else " ".join(map(str, ids)) for ids in out]
    for prompt, line in zip(prompts, lines, strict=True):
        if printing:
            print(f"{prompt} -> {line}")


def encode(
    prompts: list[str], args: argparse.Namespace, cfg: dict, model: nn.Module | None,
    tokenizer: Any,
) -> list[list[int]]:  # fmt: skip
    """The prompts as token ids: ``--text`` through the run's tokenizer, ``--prompt`` read as
    ids; every row checked against the model's vocabulary."""
    if args.text:
        rows = [tokenizer.encode(text) for text in prompts]
        for text, row in zip(prompts, rows, strict=True):
            if not row:
                fail(f"--text {text!r} encodes to no tokens")
        return rows
    return token_rows(prompts, vocabulary_size(cfg, model), tokenizer is not None)


if __name__ == "__main__":
    main()
