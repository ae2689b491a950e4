"""What each rank runs in tests/distributed/test_generate.py and test_generate_virtual.py:
decoding through a DistributedPipe (one stage per rank, or two: interleaved, zb-v) against the
plain model's uncached reference decoders in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from giantpipe.data.translation.decoding import _max_steps, beam_search, greedy_decode
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.generate import Decoding, generate, split_rows
from models.transformer import transformer_lm, transformer_t
from tests import tiny
from tests.timeouts import scaled

BOS, EOS, PAD = 2, 3, 0


def seq2seq() -> nn.Sequential:
    torch.manual_seed(1)
    model = transformer_t(2, 48, 4, d_model=32, head_dim=8, vocab_size=37, max_len=48, dropout=0.0)
    return model.eval()


def lm() -> nn.Sequential:
    torch.manual_seed(3)
    return transformer_lm(3, d_model=32, ffn_dim=48, num_heads=4, vocab_size=41, max_len=48).eval()


def translate(
    tmp: Path,
    balance: list[int],
    chunks: int,
    schedule: str = "gpipe",
    micro: int | None = None,
) -> dict[str, Any]:
    """Greedy and beam through the pipe (sources only where stage 0 is) and the one-process
    references. ``schedule`` interleaved or zb-v: 2 stages per rank (V = 2); ``micro``
    micro-batches to decode (default: ``chunks``, training's)."""
    torch.manual_seed(7)
    src = torch.randint(4, 37, (7, 6))
    src[3, 4:] = PAD
    plain = seq2seq()
    steps = _max_steps(plain, src, None)  # type: ignore[arg-type]
    reference = {
        "greedy": greedy_decode(plain, src),
        "beam": beam_search(plain, src, beam_size=3, length_penalty=0.6),
    }
    virtual = 1 if schedule == "gpipe" else 2
    pipe = DistributedPipe(
        seq2seq(),
        balance,
        chunks=chunks,
        schedule=schedule,
        virtual_stages=virtual,
        timeout=scaled(30),
    )
    micro = micro or chunks
    prompts = None
    if pipe.needs_inputs:
        prompts = [(s, torch.full((len(s), 1), BOS)) for s in split_rows(src, micro)]
    got = {}
    for name, beam in (("greedy", 1), ("beam", 3)):
        decoding = Decoding(beam_size=beam, length_penalty=0.6, eos_id=EOS, pad_id=PAD)
        out = generate(pipe, prompts, [steps] * micro, decoding, timeout=scaled(30))
        got[name] = [row for chunk in out for row in chunk]
    held = sum(p.numel() for p in pipe.parameters())
    total = sum(p.numel() for p in plain.parameters())
    return {"got": got, "reference": reference, "stages": pipe.layout.local_stages,
            "held": held, "total": total}  # fmt: skip


RAGGED = [[[5, 17, 9, 30, 2, 11], [8, 9]], [[4, 4, 21, 6], [33, 12, 40]]]
"""Prompts of unequal length, two micro-batches: each row decodes as that prompt alone."""


def sample(tmp: Path, balance: list[int]) -> dict[str, Any]:
    """Sampling through the pipe and in one process, same seed; every rank passes the prompts
    (as recipes/generate.py does), which only stage 0 may take in. Then :data:`RAGGED`,
    greedy and beam, against each prompt decoded alone in one process; and the pipe's modes
    (training, some modules not) as they were after every call."""
    prompts = split_rows(
        torch.randint(0, 41, (4, 5), generator=torch.Generator().manual_seed(0)), 2
    )
    decoding = Decoding(temperature=0.9, top_k=8, seed=4)
    alone = generate(lm(), prompts, [10, 10], decoding)
    pipe = DistributedPipe(lm(), balance, chunks=2, timeout=scaled(30))
    pipe.train()
    for module in list(pipe.modules())[1::3]:
        module.eval()
    modes = [m.training for m in pipe.modules()]
    got = generate(
        pipe, prompts, [10, 10], decoding, timeout=scaled(30)
    )  # prompts on every rank too
    ragged: dict[str, Any] = {"got": [], "alone": []}
    for search in (Decoding(), Decoding(beam_size=3, eos_id=7)):
        out = generate(pipe, RAGGED, [8, 8], search, timeout=scaled(30))
        ragged["got"].append([row for chunk in out for row in chunk])
        one = [generate(lm(), [torch.tensor([r])], [8], search)[0][0] for c in RAGGED for r in c]
        ragged["alone"].append(one)
    kept = modes == [m.training for m in pipe.modules()]
    return {"got": got, "alone": alone, "ragged": ragged, "modes_kept": kept}


TRANSLATION = [*tiny.TRANSLATION, "logger.progress=none"]
