"""What each rank runs in tests/distributed/test_generate_replicas.py: decoding through a
DistributedPipe of K stages x R replicas whose stages FSDP2 shards over the replicas, each
replica with prompts of its own (other counts of micro-batches, other lengths), against the plain
model in one process; and the most bytes of parameters gathered on the rank at once, against its
largest FSDP2 unit's (a layer, or a tied embedding and head)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from giantpipe.data.translation.decoding import _max_steps, beam_search, greedy_decode
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.distributed.replicas import units_of
from giantpipe.engine.generate import Decoding, generate, split_rows
from tests.distributed.generate_workers import BOS, EOS, PAD, lm, seq2seq


def gathered_bytes(pipe: nn.Module) -> int:
    """Bytes of this rank's parameters held whole right now: an FSDP2 parameter is a DTensor
    (its shard) between uses, a plain tensor while gathered."""
    return sum(p.nbytes for p in pipe.parameters() if not isinstance(p, DTensor))


def distinct_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the parameters of ``modules``, a shared one once."""
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.nbytes for p in params.values())


def largest_unit(model: nn.Sequential, layers: list[int]) -> int:
    """Bytes of the largest FSDP2 unit ``full`` makes of ``layers``: a layer, or the layers of
    this rank sharing a parameter (a tied embedding and head), counted whole."""
    return max(distinct_bytes(unit) for unit in units_of([model[i] for i in layers], False))


class GatherWatch:
    """The most bytes gathered at once, sampled after every FSDP2 unshard (and so after every
    all-gather, ghosts' included), and how many unshards ran."""

    def __init__(self, pipe: nn.Module) -> None:
        self.pipe, self.peak, self.calls = pipe, 0, 0
        self.original = FSDPModule.unshard

    def __enter__(self) -> GatherWatch:
        watch = self

        def unshard(module: FSDPModule, async_op: bool = False) -> Any:
            handle = watch.original(module, async_op)
            watch.calls += 1
            watch.peak = max(watch.peak, gathered_bytes(watch.pipe))
            return handle

        FSDPModule.unshard = unshard  # type: ignore[method-assign]
        return self

    def __exit__(self, *_: object) -> None:
        FSDPModule.unshard = self.original  # type: ignore[method-assign]


def replica_sources(replica: int) -> tuple[torch.Tensor, int]:
    """Replica 0 decodes 7 sentences in 3 micro-batches, replica 1 others in 1."""
    generator = torch.Generator().manual_seed(11 + replica)
    src = torch.randint(4, 37, (7 if replica == 0 else 2, 6), generator=generator)
    src[-1, 4:] = PAD
    return src, 3 if replica == 0 else 1


def decode(
    tmp: Path,
    balance: list[int],
    sharding: str = "full",
    schedule: str = "gpipe",
    lm_balance: list[int] | None = None,
) -> dict[str, Any]:
    """Greedy and beam (translation), then, given ``lm_balance``, sampling (a language model,
    other step counts per micro-batch), each replica with its own prompts; the references
    decoded in one process."""
    virtual = 1 if schedule == "gpipe" else 2
    kwargs = {"chunks": 2, "schedule": schedule, "virtual_stages": virtual, "timeout": 30}
    pipe = DistributedPipe(seq2seq(), balance, replica_sharding=sharding, **kwargs)  # type: ignore[arg-type]
    plain, r = seq2seq(), pipe.replica
    src, micro = replica_sources(r)
    steps = _max_steps(plain, src, None)  # type: ignore[arg-type]
    reference = {
        "greedy": greedy_decode(plain, src),
        "beam": beam_search(plain, src, beam_size=3, length_penalty=0.6),
    }
    prompts = [(s, torch.full((len(s), 1), BOS)) for s in split_rows(src, micro)]
    got, watch = {}, GatherWatch(pipe)
    with watch:
        for name, beam in (("greedy", 1), ("beam", 3)):
            decoding = Decoding(beam_size=beam, length_penalty=0.6, eos_id=EOS, pad_id=PAD)
            out = generate(pipe, prompts, [steps] * micro, decoding, timeout=30)
            got[name] = [row for chunk in out for row in chunk]
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    mine = [i for s in pipe.layout.local_stages for i in range(bounds[s], bounds[s + 1])]
    result = {"got": got, "reference": reference, "peak": watch.peak, "unshards": watch.calls,
              "largest_unit": largest_unit(plain, mine),
              "stages_bytes": distinct_bytes([plain[i] for i in mine]),
              "sharded_after": gathered_bytes(pipe) == 0}  # fmt: skip
    if lm_balance is not None:
        result["sampled"], result["sampled_alone"] = sample(r, lm_balance, sharding, kwargs)
    return result


def sample(
    replica: int, balance: list[int], sharding: str, kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    """A language model's samples, replica 0 with two micro-batches of 8 and 3 tokens, replica
    1 with one of 5 (fewer steps than replica 0's longest: it waits as a ghost)."""
    pipe = DistributedPipe(lm(), balance, replica_sharding=sharding, **kwargs)
    generator = torch.Generator().manual_seed(5 + replica)
    rows = torch.randint(0, 41, (4 if replica == 0 else 2, 5), generator=generator)
    prompts = split_rows(rows, 2 if replica == 0 else 1)
    steps = [8, 3] if replica == 0 else [5]
    decoding = Decoding(temperature=0.9, top_k=8, seed=2)
    got = generate(pipe, prompts, steps, decoding, timeout=30)
    return got, generate(lm(), prompts, steps, decoding)
