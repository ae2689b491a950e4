"""A checkpoint's weights as one file the plain model loads, or as a Hugging Face folder.

``pt``: ``model.load_state_dict(torch.load("model.pt"))`` on the un-pipelined model;
``safetensors``: the same state dict as one ``.safetensors`` file; ``hf``: for a model captured
from Hugging Face, ``config.json`` (the config the run recorded) and ``model.safetensors``,
which ``AutoModelForCausalLM.from_pretrained`` loads. Nothing existing is ever replaced.

Example::

    export(Path("outputs/run/last"), Path("model.safetensors"), "safetensors")
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from giantpipe.checkpoint.files import FILE_MODE, atomic_save
from giantpipe.checkpoint.load import load
from giantpipe.checkpoint.manifest import read_manifest
from giantpipe.checkpoint.names import MANIFEST

__all__ = ["FORMATS", "ExportError", "consolidate", "export", "merged", "summary"]

FORMATS = ("pt", "safetensors", "hf")
_UMASK = 0o666 & ~FILE_MODE


class ExportError(ValueError):
    """An export that cannot be made; the message names the path or the option."""


def merged(directory: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every weight, in the plain model's layer order, and the manifest."""
    manifest = read_manifest(directory)
    state = load(directory)
    position = {name: i for i, name in enumerate(state)}
    ordered = dict(sorted(state.items(), key=lambda kv: (_layer(kv[0]), position[kv[0]])))
    return ordered, manifest


def consolidate(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Merges every weight into one state dict at ``out`` (atomic); returns :func:`summary`."""
    ordered, manifest = merged(directory)
    atomic_save(ordered, out)
    return summary(ordered, manifest)


def summary(state: dict[str, torch.Tensor], manifest: dict[str, Any]) -> dict[str, Any]:
    """Tensors, bytes, shards and step of a merged checkpoint (what consolidate prints)."""
    return {
        "tensors": len(state),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "shards": len(manifest["shards"]),
        "step": manifest["step"],
    }


def _layer(name: str) -> int:
    """The plain model's layer index of a parameter name ("12.fc.weight" -> 12)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def export(directory: Path, out: Path, kind: str = "pt") -> dict[str, Any]:
    """Writes ``directory``'s weights to ``out`` in ``kind`` (pt, safetensors or hf); returns
    what :func:`summary` says of them. ExportError naming the path or option when it cannot;
    CheckpointDamaged naming a damaged file."""
    if kind not in FORMATS:
        raise ExportError(f"--format: unknown format {kind!r}; choose pt, safetensors or hf")
    if out.exists() or out.is_symlink():
        raise ExportError(f"{out} exists; nothing was overwritten (choose a new path)")
    if not (directory / MANIFEST).is_file():
        raise ExportError(f"{directory / MANIFEST}: no checkpoint there")
    state, manifest = merged(directory)
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
