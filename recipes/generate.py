"""Generate with a trained run: cached decoding through the pipeline (giantpipe.engine.generate).

Command:     python recipes/generate.py RUN/last --prompt "12 7 9"            # transformer_lm
             python recipes/generate.py RUN/last --prompt "the dog ." --to xa  # transformer_t
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
language model's prompt is token ids; a translation model's is text in the run's SentencePiece
vocabulary (RUN/spm.model, or data.vocab_dir), translated into --to.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

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
from giantpipe.perf.balance import even_balance
from giantpipe.runner.build import capture
from giantpipe.runner.checkpoint.init_from import matching, read_weights


def read_config(checkpoint: Path) -> dict[str, Any]:
    """The run's resolved config (config.yaml beside the checkpoint)."""
    config_file = checkpoint.parent / "config.yaml"
    if not config_file.is_file():
        sys.exit(f"no config.yaml beside {checkpoint}: the run's model cannot be rebuilt")
    cfg: dict[str, Any] = yaml.safe_load(config_file.read_text())
    return cfg


def build_model(cfg: dict[str, Any]) -> nn.Sequential:
    """The run's model as the flat Sequential its pipe cut: built from the config; a model that
    is not one (model=hf_causal_lm) is captured as the runner captured it, at the run's
    pipeline.split_points, its pieces given their key/value caches."""
    model = instantiate(cfg["model"])
    if isinstance(model, nn.Sequential):
        return model
    pipeline = cfg.get("pipeline") or {}
    sample = (torch.zeros(2, 8, dtype=torch.long),)  # token ids: a causal LM's input
    try:
        return capture(model, sample, pipeline.get("split_points"), pipeline.get("output"))
    except ConfigError as err:  # e.g. the run's split points no longer name submodules
        sys.exit(f"error: {err}")


def load_model(checkpoint: Path) -> tuple[nn.Sequential, dict[str, Any]]:
    """The run's model (from the config.yaml beside the checkpoint) with the saved weights."""
    cfg = read_config(checkpoint)
    model = build_model(cfg)
    weights = read_weights(checkpoint)
    live = model.state_dict()
    found = matching(weights, live)
    missing = sorted(set(live) - set(found))
    if missing:
        sys.exit(f"{checkpoint} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    model.load_state_dict(found)
    return model.eval(), cfg


def distributed_pipe(checkpoint: Path, cfg: dict, chunks: int) -> tuple[nn.Module, bool]:
    """This rank's stage of the model (built on meta, only its layers allocated and loaded)."""
    import torch.distributed as dist

    from giantpipe.engine.dist.layout import init_distributed
    from giantpipe.engine.dist.pipe import DistributedPipe

    init_distributed()
    with torch.device("meta"):  # the children's count only: no weights anywhere
        probe = instantiate(cfg["model"])
    if isinstance(probe, nn.Sequential):
        layers, build = len(probe), lambda: instantiate(cfg["model"])
    else:  # captured on every rank, as the runner does; each rank then keeps its stage only
        captured = build_model(cfg)
        layers, build = len(captured), lambda: captured
    balance = even_balance(layers, dist.get_world_size())
    pipe = DistributedPipe(build, balance, chunks=chunks, init=None)
    own = pipe.state_dict()
    found = matching(read_weights(checkpoint), own)
    if set(found) != set(own):
        sys.exit(f"{checkpoint} lacks tensors of rank {dist.get_rank()}'s stage")
    pipe.load_state_dict(found)
    return pipe.eval(), dist.get_rank() == 0


def continue_tokens(pipe: nn.Module, prompts: list[str], args: argparse.Namespace) -> list[str]:
    """A language model: each prompt (token ids) continued; equal lengths share a micro-batch."""
    rows = [[int(t) for t in p.split()] for p in prompts]
    lengths = sorted({len(r) for r in rows})
    groups = [[i for i, r in enumerate(rows) if len(r) == n] for n in lengths]
    batches = [torch.tensor([rows[i] for i in g]) for g in groups]
    decoding = Decoding(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    out = generate(pipe, batches, [args.max_new] * len(batches), decoding)
    lines = [""] * len(rows)
    for group, tokens in zip(groups, out, strict=True):
        for i, ids in zip(group, tokens, strict=True):
            lines[i] = " ".join(map(str, ids))
    return lines


def translate(
    pipe: nn.Module, prompts: list[str], cfg: dict, args: argparse.Namespace
) -> list[str]:
    """A translation model: each sentence into ``--to``, in the run's vocabulary."""
    from giantpipe.data.translation.vocabulary import SharedVocabulary

    vocab_dir = cfg.get("data", {}).get("vocab_dir") or args.checkpoint.parent
    vocab = SharedVocabulary(Path(vocab_dir) / "spm.model")
    rows = [[vocab.lang_id(args.to), *vocab.encode(p), vocab.eos_id] for p in prompts]
    src = torch.full((len(rows), max(map(len, rows))), vocab.pad_id)
    for i, row in enumerate(rows):
        src[i, : len(row)] = torch.tensor(row)
    hyps = pipelined_decode(pipe, src, beam_size=args.beam, length_penalty=args.length_penalty)
    return [vocab.decode(ids) for ids in hyps]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="RUN/last, RUN/step_N or a state_dict file")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several")
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
    printing = True
    if "RANK" in os.environ:  # under torchrun: one stage per process
        cfg = read_config(args.checkpoint)
        pipe, printing = distributed_pipe(args.checkpoint, cfg, args.chunks)
        seq2seq = cfg["model"]["_target_"].endswith("transformer_t")
    else:
        model, cfg = load_model(args.checkpoint)
        pipe = model.to(args.device)
        if args.stages > 1 or args.chunks > 1:
            balance = even_balance(len(model), args.stages)
            pipe = GPipe(model, balance, devices=[args.device] * args.stages, chunks=args.chunks)
        seq2seq = hasattr(model, "encode")
    if seq2seq:  # an encoder-decoder: models.transformer.EncoderDecoder
        if args.to is None:
            sys.exit("a translation model needs --to LANG (the target language)")
        lines = translate(pipe, args.prompt, cfg, args)
    else:
        lines = continue_tokens(pipe, args.prompt, args)
    for prompt, line in zip(args.prompt, lines, strict=True):
        if printing:
            print(f"{prompt} -> {line}")


if __name__ == "__main__":
    main()
