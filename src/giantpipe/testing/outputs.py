"""Where a benchmark or recipe script writes its report: ``outputs/NAME``, or the repository's
tracked ``results/NAME`` only when asked with ``--update-results`` (the same flag in every
script), so that trying a command from the docs rewrites none of the figures the docs cite.

Example:

>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_output_options(parser, "table2")
>>> output_path(parser.parse_args([]), Path("/repo"), "table2")
PosixPath('outputs/table2')
>>> output_path(parser.parse_args(["--update-results"]), Path("/repo"), "table2")
PosixPath('/repo/results/table2')
>>> output_path(parser.parse_args(["--out", "/tmp/t2"]), Path("/repo"), "table2")
PosixPath('/tmp/t2')
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["UPDATE_RESULTS", "add_output_options", "output_path"]

UPDATE_RESULTS = "--update-results"
"""The flag that points a script at the repository's ``results/`` (the tracked figures)."""


def add_output_options(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out PATH`` and ``--update-results`` (one or the other), for :func:`output_path`."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        type=Path,
        help=f"write the report here (default: outputs/{name})",
    )
    where.add_argument(
        UPDATE_RESULTS,
        action="store_true",
        help=f"write into the repository's results/{name}, the figures the docs cite, instead "
        f"of outputs/{name}",
    )


def output_path(args: argparse.Namespace, root: Path, name: str) -> Path:
    """``--out``, else ``root/results/NAME`` with ``--update-results``, else ``outputs/NAME``
    (beside where the script runs, like ``train.py``'s run directories)."""
    if args.out is not None:
        return Path(args.out)
    return root / "results" / name if args.update_results else Path("outputs") / name
