"""What each rank runs in tests/distributed/test_generate_hf.py: a Hugging Face Llama captured
by ``sequentialize``, its pieces given key/value caches (models.hf), decoded through a
DistributedPipe (one stage per rank) and in one process."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import torch

from giantpipe import sequentialize
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.generate import Decoding, generate, split_rows
from models.hf import give_caches, hf_causal_lm
from tests.timeouts import scaled

VOCAB = 50


def llama_pieces() -> Any:
    model = hf_causal_lm(
        "llama", 3, 32, 4, VOCAB, kv_heads=2, config={"initializer_range": 0.3}
    )  # attention that looks at positions (at the default 0.02 it is near uniform)
    ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    seq = sequentialize(model.eval(), ids, output="logits")
    give_caches(model, list(seq), seq.spans)
    return seq


def decode(tmp: Path, balance: list[int], chunks: int) -> dict[str, Any]:
    """Greedy and beam through the pipe (prompts only where stage 0 is) and in one process,
    and prompts of unequal length (greedy) against each alone; which of the model's parameters
    this rank still keeps alive once it has its stage."""
    prompts = torch.randint(1, VOCAB, (5, 6), generator=torch.Generator().manual_seed(5))
    searches = {"greedy": Decoding(), "beam": Decoding(beam_size=3, eos_id=7)}
    alone, whole = {}, llama_pieces()
    for name, decoding in searches.items():
        out = generate(whole, split_rows(prompts, chunks), [8] * chunks, decoding)
        alone[name] = [row for chunk in out for row in chunk]
    ragged = [[[5, 17, 9, 30, 2, 11], [8, 9]], [[4, 4, 21, 6], [33, 12, 40]]]
    one = [generate(whole, [torch.tensor([r])], [8], Decoding())[0][0] for c in ragged for r in c]
    alone["ragged"] = one
    del whole
    seq = llama_pieces()
    every = [weakref.ref(p) for p in seq.parameters()]
    total = sum(p.numel() for p in seq.parameters())
    pipe = DistributedPipe(seq, balance, chunks=chunks, timeout=scaled(30))
    del seq
    gc.collect()
    alive = sum(p.numel() for r in every if (p := r()) is not None)
    got = {}
    for name, decoding in searches.items():
        feed = split_rows(prompts, chunks) if pipe.needs_inputs else None
        out = generate(pipe, feed, [8] * chunks, decoding, timeout=scaled(30))
        got[name] = [row for chunk in out for row in chunk]
    out = generate(
        pipe, ragged if pipe.needs_inputs else None, [8, 8], Decoding(), timeout=scaled(30)
    )
    got["ragged"] = [row for chunk in out for row in chunk]
    held = sum(p.numel() for p in pipe.parameters())
    return {"got": got, "alone": alone, "held": held, "alive": alive, "total": total}
