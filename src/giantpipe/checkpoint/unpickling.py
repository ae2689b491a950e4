"""Safe loading: ``torch.load`` with ``weights_only`` and the short allow-list of what a
checkpoint may hold besides tensors and plain values; anything that would run code is refused.

Example::

    state = safe_load(Path("outputs/run/last.pt"))     # CheckpointError naming the file
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from giantpipe.checkpoint.errors import CheckpointError

__all__ = ["safe_load"]


def _allowed() -> list[Any]:
    """What a checkpoint may hold besides tensors and plain values: numpy's RNG state, as
    checkpoints of the earlier format saved it (when numpy was loaded)."""
    try:
        import numpy as np
        from numpy._core.multiarray import _reconstruct
    except ImportError:
        return []
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def safe_load(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` with ``weights_only``: tensors, plain values and numpy's RNG state, nothing
    that runs code. ``mmap``: tensors stay in the file until touched (a file of torch's older,
    unzipped format is read whole). A file that needs more, or is no torch file, is a
    CheckpointError naming it."""
    try:
        with torch.serialization.safe_globals(_allowed()):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as err:
                if not mmap or "zipfile" not in str(err):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(err))
        if unsafe is None:
            raise CheckpointError(path, "is not a readable checkpoint (not a torch file)") from err
        raise CheckpointError(
            path,
            f"holds {unsafe.group(1)}, which giantpipe never saves; refused without running it "
            "(load it yourself only if you trust where it came from)",
        ) from err
    except Exception as err:  # a truncated or foreign file: say which one
        raise CheckpointError(path, f"is not a readable checkpoint ({err})") from err
