"""Merge a checkpoint's weights into one file the plain model loads, or export them.

Usage::

    python -m giantpipe.consolidate RUN/last model.pt           # torch.save (the default)
    # wrote 26 tensors (1.3 MiB) from 2 shards (step 100) to model.pt
    python -m giantpipe.consolidate RUN/last model.safetensors --format safetensors
    python -m giantpipe.consolidate RUN/last llama/ --format hf   # from_pretrained("llama/")

``pt``: ``model.load_state_dict(torch.load("model.pt"))`` on the un-pipelined model;
``safetensors``: the same state dict as one ``.safetensors`` file; ``hf``: for a model captured
from Hugging Face (``model=hf_causal_lm``), a directory with ``config.json`` (the config the run
recorded in its manifest) and ``model.safetensors``, which ``AutoModelForCausalLM
.from_pretrained`` loads. Every file read is checked against the manifest's hashes first; a
bad input is one line naming the path, exit status 1, and nothing is written (an existing OUT is
never replaced). Runs in one process, without torch.distributed; see
:mod:`giantpipe.engine.distributed.shards` for the layout on disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from giantpipe.engine.distributed.shards import (
    FILE_MODE,
    CheckpointDamaged,
    atomic_save,
    merged,
    summary,
)
from giantpipe.runner.checkpoint.reading import kept_beside

FORMATS = ("pt", "safetensors", "hf")
_UMASK = 0o666 & ~FILE_MODE


class ExportError(ValueError):
    """An export that cannot be made; the message names the path or the option."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m giantpipe.consolidate",
        description="Merge a checkpoint's weights (a directory with manifest.json) into one file.",
    )
    parser.add_argument("directory", help="checkpoint directory, e.g. outputs/.../last")
    parser.add_argument("out", help="output: a .pt or .safetensors file, or a directory (hf)")
    parser.add_argument("--format", default="pt", help="pt (default), safetensors or hf")
    args = parser.parse_args(argv)
    try:
        done = export(Path(args.directory), Path(args.out), args.format)
    except (OSError, ValueError, KeyError) as exc:
        print(f"consolidate: {_line(exc)}", file=sys.stderr)
        return 1
    print(
        f"wrote {done['tensors']} tensors ({done['bytes'] / 2**20:.1f} MiB) from "
        f"{done['shards']} shards (step {done['step']}) to {args.out}"
    )
    return 0


def _line(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return str(exc.args[0])
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def export(directory: Path, out: Path, kind: str = "pt") -> dict[str, Any]:
    """Writes ``directory``'s weights to ``out`` in ``kind`` (pt, safetensors or hf); returns
    what :func:`~giantpipe.engine.distributed.shards.summary` says of them.

    Example::

        export(Path("outputs/run/last"), Path("model.safetensors"), "safetensors")
    """
    if kind not in FORMATS:
        raise ExportError(f"--format: unknown format {kind!r}; choose pt, safetensors or hf")
    if out.exists() or out.is_symlink():
        raise ExportError(f"{out} exists; nothing was overwritten (choose a new path)")
    if not (directory / "manifest.json").is_file():
        raise ExportError(f"{directory / 'manifest.json'}: no checkpoint there")
    try:
        state, manifest = merged(directory)
    except CheckpointDamaged as err:
        kept = kept_beside(directory)
        raise ExportError(f"{err}; export {kept} instead" if kept else str(err)) from err
    if kind == "hf":
        config = _hf_config(directory, manifest)
        _place(out, lambda tmp: _write_hf(state, config, tmp), directory=True)
    elif kind == "safetensors":
        _place(out, lambda tmp: _write_safetensors(state, tmp))
    else:
        _place(out, lambda tmp: atomic_save(state, tmp))
    return summary(state, manifest)


def _place(out: Path, write: Callable[[Path], Any], directory: bool = False) -> None:
    """``write`` to a temporary path beside ``out``, then moved to ``out`` unless something
    appeared there meanwhile (nothing existing is ever replaced)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        target = tmp if directory else tmp / out.name
        write(target)
        for path in [target, *(target.iterdir() if directory else [])]:
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_UMASK)  # as open() would
        if directory:
            os.rename(tmp, out)  # fails onto any non-empty directory; `out` was checked absent
        else:
            _link(target, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _link(target: Path, out: Path) -> None:
    """``target`` under the name ``out``, which must not exist (not even after a race)."""
    try:
        os.link(target, out)
    except FileExistsError as err:
        raise ExportError(f"{out} exists; nothing was overwritten (choose a new path)") from err
    except OSError:  # a file system without hard links
        if out.exists():
            raise
        os.rename(target, out)


def _write_safetensors(state: dict[str, Tensor], path: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ExportError(
            "--format safetensors needs safetensors: pip install safetensors"
        ) from err
    # "format": "pt" is what Hugging Face's loaders expect of a PyTorch file
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})


def _hf_config(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config the run recorded; ExportError naming the model otherwise."""
    record = (manifest.get("extra") or {}).get("model") or {}
    config = record.get("hf_config")
    if not isinstance(config, dict) or "model_type" not in config:
        built = record.get("target") or "a builder this checkpoint does not record"
        raise ExportError(
            f"--format hf: {directory} holds a model built by {built}, not one captured from "
            "Hugging Face (model=hf_causal_lm); export it with --format safetensors or pt"
        )
    return config


def _write_hf(state: dict[str, Tensor], config: dict[str, Any], folder: Path) -> None:
    """``config.json`` and ``model.safetensors``, as ``save_pretrained`` lays them out."""
    try:
        import transformers
    except ImportError as err:
        raise ExportError('--format hf needs transformers: pip install -e ".[hf]"') from err
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf = transformers.AutoConfig.for_model(config["model_type"], **fields)
    if not getattr(hf, "architectures", None):  # tells loaders which head the weights fit
        names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        hf.architectures = [names[config["model_type"]]]
    hf.save_pretrained(folder)
    _write_safetensors(state, folder / "model.safetensors")


if __name__ == "__main__":
    sys.exit(main())
