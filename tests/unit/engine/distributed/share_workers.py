"""What each rank of tests/unit/engine/distributed/test_k2_r2.py checks of building by share: a
:class:`DistributedPipe` built from a model on meta, K=2 x R=2 with ``replica_sharding=full``.

1. the initial weights: each parameter's whole value (its shards gathered) equals the plain
   model's, initialised layer by layer as the local executor initialises it;
2. what the rank holds: its parameters' storage is exactly its FSDP2 shard of its stage (each
   tensor's dim 0 cut in R, padded as FSDP2 pads it), and building it never held more than
   that share and one whole layer at a time (live bytes counted under a dispatch mode, the CPU
   having no allocator statistics).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_iter

from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.meta import init_layers
from giantpipe.perf.memory import LiveBytesTracker
from giantpipe.testing.held import training_bytes

INIT, WIDTH, DEPTH, K = 7, 256, 16, 2


def deep() -> nn.Sequential:
    """16 equal layers: a stage of 8 dwarfs a layer, so holding it whole would show."""
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


class HostBytes(LiveBytesTracker):
    """The live-bytes tracker of real storages only: a meta tensor's holds nothing, and a
    DTensor's is its local tensor's, counted when that is made."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.track(t for t in tree_iter(out) if type(t) is torch.Tensor and not t.is_meta)
        return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_bytes(param: nn.Parameter, replicas: int) -> int:
    """FSDP2's shard of ``param`` on one rank: dim 0 cut in ``replicas`` (rounded up)."""
    rows = math.ceil(param.shape[0] / replicas)
    return rows * math.prod(param.shape[1:]) * param.element_size()


def check_share() -> dict[str, Any]:
    plain = deep()
    init_layers(plain, INIT)
    layer_bytes = sum(p.nbytes for p in plain[0].parameters())
    with HostBytes() as built:
        pipe = DistributedPipe(deep, [DEPTH // K] * K, chunks=2, seed=INIT, timeout=20)
    replicas = dist.get_world_size() // K
    named = dict(pipe.named_parameters())
    equal = all(torch.equal(full(p), plain.get_parameter(n)) for n, p in named.items())
    share = sum(shard_bytes(plain.get_parameter(n), replicas) for n in named)
    held = training_bytes(pipe.parameters())["params"]
    pipe.release()
    return {
        "equal": equal,
        "names": len(named),
        "held": held,
        "share": share,
        "peak": built.peak,
        "layer": layer_bytes,
        "stage": layer_bytes * DEPTH // K,
    }
