"""Merge a distributed pipeline's checkpoint shards into one file the plain model loads.

Usage::

    python -m giantpipe.consolidate ckpt/ model.pt
    # wrote 26 tensors (1.3 MiB) from 2 shards (step 100) to model.pt

then ``model.load_state_dict(torch.load("model.pt"))`` on the un-pipelined model. Runs in one
process, without torch.distributed; see :mod:`giantpipe.engine.dist.shards` for the layout on disk.
"""

from __future__ import annotations

import argparse
import sys

from giantpipe.engine.dist.shards import consolidate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m giantpipe.consolidate",
        description="Merge checkpoint shards (a directory with manifest.json) into one .pt file.",
    )
    parser.add_argument("directory", help="shard directory written by DistributedPipe")
    parser.add_argument("out", help="output file, e.g. model.pt (written atomically)")
    args = parser.parse_args(argv)
    try:
        summary = consolidate(args.directory, args.out)
    except (OSError, ValueError, KeyError) as exc:
        print(f"consolidate: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {summary['tensors']} tensors ({summary['bytes'] / 2**20:.1f} MiB) from "
        f"{summary['shards']} shards (step {summary['step']}) to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
