"""The heavy half of ``recipes/generate.py``: once its arguments and the run's config hold, the
run's model is rebuilt and loaded (whole, or this rank's stage under torchrun) and the prompts
are decoded. Bad input is :class:`BadInput`, which the script prints as one line, exit 2.

Example::

    for line in generated_lines(args, Path("RUN/last"), config):
        print(line)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, NoReturn

import torch
from hydra.utils import instantiate
from torch import nn

from giantpipe import GPipe
from giantpipe.config import ConfigError
from giantpipe.data.translation.decoding import pipelined_decode
from giantpipe.engine.generate import Decoding, generate
from giantpipe.engine.generate.caches import check_cached
from giantpipe.perf.balance import even_balance
from giantpipe.runner.model import capture
from giantpipe.runner.run_state.init_from import matching, read_weights


class BadInput(Exception):
    """Input the run cannot generate from (a damaged checkpoint, a model that cannot decode,
    ids outside the vocabulary, ...): one line naming it."""


def fail(message: str) -> NoReturn:
    raise BadInput(message)


def generated_lines(args: argparse.Namespace, checkpoint: Path, cfg: dict[str, Any]) -> list[str]:
    """``PROMPT -> CONTINUATION`` per prompt (none on a rank other than 0 under torchrun)."""
    seq2seq = str(cfg["model"].get("_target_", "")).endswith("transformer_t")
    prompts: list[str] = args.prompt or args.text
    tokenizer = None if seq2seq else run_tokenizer(cfg, checkpoint.parent)
    printing = True
    if "RANK" in os.environ:  # under torchrun: one stage per process
        rows = None if seq2seq else encode(prompts, args, cfg, None, tokenizer)
        pipe, printing = distributed_pipe(checkpoint, cfg, args.chunks)
    else:
        model = load_model(checkpoint, cfg)
        rows = None if seq2seq else encode(prompts, args, cfg, model, tokenizer)
        pipe = model.to(args.device)
        if args.stages > 1 or args.chunks > 1:
            balance = even_balance(len(model), args.stages)
            pipe = GPipe(model, balance, devices=[args.device] * args.stages, chunks=args.chunks)
    if seq2seq:
        lines = translate(pipe, prompts, cfg, args, checkpoint.parent)
    else:
        words = args.text is not None
        stage0 = getattr(pipe, "needs_inputs", True)
        eos = tokenizer.eos_id if words else None  # words stop at the end of text
        out = continue_rows(pipe, rows if stage0 else None, args, eos)
        lines = [tokenizer.decode(ids).strip() if words else " ".join(map(str, ids)) for ids in out]
    if "RANK" in os.environ:  # every group freed before the interpreter's shutdown
        from giantpipe.engine.distributed.layout import end_distributed

        pipe.release()
        end_distributed()
    if not printing:
        return []
    return [f"{prompt} -> {line}" for prompt, line in zip(prompts, lines, strict=True)]


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
    pipe: nn.Module, prompts: list[str], cfg: dict, args: argparse.Namespace, run_dir: Path
) -> list[str]:
    """A translation model: each sentence into ``--to``, in the run's vocabulary."""
    from giantpipe.data.translation.vocabulary import SharedVocabulary

    vocab_dir = cfg.get("data", {}).get("vocab_dir") or run_dir
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
