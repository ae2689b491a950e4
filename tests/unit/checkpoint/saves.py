"""What the checkpoint tests share: small weights, and one process's save and commit of them."""

from __future__ import annotations

from pathlib import Path

import torch

from giantpipe.checkpoint.names import new_token
from giantpipe.checkpoint.save import save_collective


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"0.weight": torch.randn(32, 32), "0.bias": torch.randn(32), "2.weight": torch.randn(4)}


def save(directory: Path, tensors: dict[str, torch.Tensor], step: int = 1) -> str:
    """One process's save and commit, as DistributedPipe.save_checkpoint makes them."""
    token = new_token(step)
    entry = {"rank": 0, "stages": [0], "names": list(tensors)}
    meta = {"step": step, "balance": [3], "schedule": "gpipe", "chunks": 1, "workers": 1}
    meta.update(replicas=1, placement=[0])
    save_collective(directory, token, tensors, {}, entry, (meta, {}), None)
    return token
