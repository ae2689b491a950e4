"""What each rank runs in tests/distributed/test_generate_virtual.py: decoding through a
DistributedPipe whose ranks hold several stages (interleaved, zb-v), against the plain model's
uncached reference decoders in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from giantpipe.data.bleu import _max_steps, beam_search, greedy_decode
from giantpipe.engine.dist.pipe import DistributedPipe
from giantpipe.engine.generate import Decoding, generate, split_rows
from tests.distributed.generate_workers import BOS, EOS, PAD, seq2seq


def translate(
    tmp: Path, balance: list[int], schedule: str, chunks: int, micro: int
) -> dict[str, Any]:
    """Greedy and beam through a pipe of ``schedule`` (2 stages per rank), ``micro``
    micro-batches, sources only where stage 0 is; and the one-process references."""
    torch.manual_seed(7)
    src = torch.randint(4, 37, (7, 6))
    src[3, 4:] = PAD
    plain = seq2seq()
    steps = _max_steps(plain, src, None)  # type: ignore[arg-type]
    reference = {
        "greedy": greedy_decode(plain, src),
        "beam": beam_search(plain, src, beam_size=3, length_penalty=0.6),
    }
    pipe = DistributedPipe(
        seq2seq(), balance, chunks=chunks, schedule=schedule, virtual_stages=2, timeout=30
    )
    prompts = None
    if pipe.needs_inputs:
        prompts = [(s, torch.full((len(s), 1), BOS)) for s in split_rows(src, micro)]
    got = {}
    for name, beam in (("greedy", 1), ("beam", 3)):
        decoding = Decoding(beam_size=beam, length_penalty=0.6, eos_id=EOS, pad_id=PAD)
        out = generate(pipe, prompts, [steps] * micro, decoding, timeout=30)
        got[name] = [row for chunk in out for row in chunk]
    held = sum(p.numel() for p in pipe.parameters())
    total = sum(p.numel() for p in plain.parameters())
    return {"got": got, "reference": reference, "stages": pipe.layout.local_stages,
            "held": held, "total": total}  # fmt: skip
