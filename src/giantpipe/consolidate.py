"""``python -m giantpipe.consolidate``: a checkpoint's weights exported, tensor by tensor
(:mod:`giantpipe.checkpoint.export`; docs/checkpoints.md#exporting). A bad input is one line
naming the path, exit status 2, and nothing is written.

Usage::

    python -m giantpipe.consolidate RUN/last model.pt           # torch.save (the default)
    # wrote 26 tensors (1.3 MiB) from 2 shards (step 100) to model.pt
    python -m giantpipe.consolidate RUN/last model.safetensors --format safetensors
    python -m giantpipe.consolidate RUN/last llama/ --format hf --max-shard-size 2GB
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

from giantpipe.checkpoint.errors import CheckpointDamaged, CheckpointError
from giantpipe.checkpoint.export import DEFAULT_SHARD, ExportError, export, parse_size

BAD_INPUT = 2
"""The exit status of a bad input, as ``train.py``'s."""


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: the size from which an allocation gets a mapping of its own."""


def return_freed_buffers() -> None:
    """Has glibc's malloc serve every buffer of 1 MiB or more from a mapping of its own, given
    back when freed. By default the threshold rises to the largest buffer freed so far, after
    which the next ones come from a heap that keeps what it frees, and an export's memory
    would grow with the model however it streams (results/checkpoints/share.md). Nothing
    where the C library is another."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 2**20)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    return_freed_buffers()
    parser = argparse.ArgumentParser(
        prog="python -m giantpipe.consolidate",
        description="Merge a checkpoint's weights (a directory with manifest.json) into one file.",
    )
    parser.add_argument("directory", help="checkpoint directory, e.g. outputs/.../last")
    parser.add_argument("out", help="output: a .pt or .safetensors file, or a directory (hf)")
    parser.add_argument("--format", default="pt", help="pt (default), safetensors or hf")
    parser.add_argument(
        "--max-shard-size",
        help=f"largest safetensors file of a folder (hf, or safetensors into a folder), e.g. "
        f"2GB or 500MiB; default {DEFAULT_SHARD}",
    )
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    try:
        limit = None if args.max_shard_size is None else parse_size(args.max_shard_size)
        done = export(directory, Path(args.out), args.format, limit)
    except CheckpointDamaged as err:
        from giantpipe.runner.rundir import kept_beside  # the runner, only when it is needed

        kept = kept_beside(directory)
        print(f"consolidate: {err}" + (f"; export {kept} instead" if kept else ""), file=sys.stderr)
        return BAD_INPUT
    except (CheckpointError, ExportError) as err:
        print(f"consolidate: {err}", file=sys.stderr)
        return BAD_INPUT
    except OSError as err:  # the disk, not the input (a full one: nothing was written)
        print(f"consolidate: {_line(err)}", file=sys.stderr)
        return 1
    print(
        f"wrote {done['tensors']} tensors ({done['bytes'] / 2**20:.1f} MiB) from "
        f"{done['shards']} shards (step {done['step']}) to {args.out}"
    )
    return 0


def _line(err: OSError) -> str:
    return f"{err.filename}: {err.strerror or err}" if err.filename is not None else str(err)


if __name__ == "__main__":
    sys.exit(main())
