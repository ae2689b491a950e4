"""A checkpoint's weights exported tensor by tensor: one ``torch.save`` file the plain model
loads, safetensors (one file, or shards with an index), or a Hugging Face folder
``from_pretrained`` loads. A file's layout is written first (names, dtypes and shapes are in the
checkpoint's index), then each tensor is read, written and let go: peak memory is the largest
tensor, not the model. Nothing existing is ever replaced.

Example::

    export(Path("outputs/run/last"), Path("llama"), "hf", max_shard_bytes=parse_size("5GB"))
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from giantpipe.checkpoint.files import FILE_MODE
from giantpipe.checkpoint.load import open_tensors
from giantpipe.checkpoint.manifest import read_manifest, weight_names
from giantpipe.checkpoint.names import MANIFEST
from giantpipe.checkpoint.safetensors_files import raw_bytes, write_file, write_shards
from giantpipe.checkpoint.sources import TensorLayout

__all__ = [
    "DEFAULT_SHARD",
    "FORMATS",
    "ExportError",
    "Weights",
    "consolidate",
    "export",
    "merged",
    "parse_size",
    "write_pt",
]

FORMATS = ("pt", "safetensors", "hf")
DEFAULT_SHARD = "5GB"
"""The largest safetensors file of a folder export (``--max-shard-size``): what the Hub serves
comfortably, and ``save_pretrained``'s default before transformers 5."""
_UMASK = 0o666 & ~FILE_MODE


class ExportError(ValueError):
    """An export that cannot be made; the message names the path or the option."""


class Weights:
    """A checkpoint's weights in the plain model's layer order, read one tensor at a time."""

    def __init__(self, directory: Path) -> None:
        self.manifest = read_manifest(directory)
        self.source = open_tensors(directory)
        names = weight_names(self.manifest)
        position = {n: i for i, n in enumerate(names)}
        ordered = sorted(names, key=lambda n: (_layer(n), position[n]))
        self.layouts = {n: self.source.layout(n) for n in ordered}

    def tensor(self, name: str) -> Tensor:
        """The weight ``name``, read alone."""
        return self.source.read([name])[name]

    def summary(self) -> dict[str, Any]:
        """Tensors, bytes, shards and step (what ``python -m giantpipe.consolidate`` prints)."""
        return {
            "tensors": len(self.layouts),
            "bytes": sum(t.nbytes for t in self.layouts.values()),
            "shards": len(self.manifest["shards"]),
            "step": self.manifest["step"],
        }


def _layer(name: str) -> int:
    """The plain model's layer index of a parameter name ("12.fc.weight" -> 12)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def merged(directory: str | os.PathLike[str]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every weight at once, in the plain model's layer order, and the manifest: to look into a
    checkpoint that fits in memory (an export never holds them all)."""
    weights = Weights(Path(directory))
    return {n: weights.tensor(n) for n in weights.layouts}, weights.manifest


def consolidate(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Every weight into one ``torch.save`` file at ``out`` (a new path), tensor by tensor;
    returns what :meth:`Weights.summary` says."""
    return export(Path(directory), Path(out), "pt")


def parse_size(text: str) -> int:
    """Bytes from ``5GB`` (10**9), ``500MiB`` (2**20), ``2e9`` or ``4096``, as
    ``save_pretrained``'s ``max_shard_size`` reads them.

    >>> parse_size("5GB"), parse_size("500MiB"), parse_size("4096")
    (5000000000, 524288000, 4096)
    """
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units.update(KIB=2**10, MIB=2**20, GIB=2**30, TIB=2**40)
    found = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    try:
        if found is None or found.group(2).upper() not in units:
            raise ValueError(text)
        size = int(float(found.group(1)) * units[found.group(2).upper()])
    except ValueError:
        size = 0
    if size < 1:
        raise ExportError(f"--max-shard-size: {text!r} is no size (e.g. 5GB, 500MiB, 4096)")
    return size


def export(
    directory: Path, out: Path, kind: str = "pt", max_shard_bytes: int | None = None
) -> dict[str, Any]:
    """Writes ``directory``'s weights to ``out`` (a new path) in ``kind``: ``pt``, one file;
    ``safetensors``, one file (``out`` ends in ``.safetensors``) or a folder of shards of at
    most ``max_shard_bytes`` with an index; ``hf``, a folder with ``config.json``. Returns
    :meth:`Weights.summary`. ExportError naming the path or option when it cannot be made,
    CheckpointDamaged naming a damaged file; either way nothing is written."""
    if kind not in FORMATS:
        raise ExportError(f"--format: unknown format {kind!r}; choose pt, safetensors or hf")
    one_file = kind == "pt" or (kind == "safetensors" and out.suffix == ".safetensors")
    if one_file and max_shard_bytes is not None:
        raise ExportError(
            f"--max-shard-size: {out} is one file; give a folder (no .safetensors suffix) "
            "for safetensors shards, or leave the option out"
        )
    if out.exists() or out.is_symlink():
        raise ExportError(f"{out} exists; nothing was overwritten (choose a new path)")
    if not (directory / MANIFEST).is_file():
        raise ExportError(f"{directory / MANIFEST}: no checkpoint there")
    weights = Weights(directory)
    limit = max_shard_bytes or parse_size(DEFAULT_SHARD)
    if kind == "hf":
        config = _hf_config(directory, weights.manifest)
        _place(out, lambda tmp: _write_hf(weights, config, tmp, limit), directory=True)
    elif not one_file:
        _place(out, lambda tmp: write_shards(tmp, weights.layouts, weights.tensor, limit), True)
    elif kind == "safetensors":
        _place(out, lambda tmp: write_file(tmp, weights.layouts, weights.tensor))
    else:
        _place(out, lambda tmp: write_pt(tmp, weights.layouts, weights.tensor))
    return weights.summary()


def write_pt(
    path: Path, layouts: dict[str, TensorLayout], tensor_of: Callable[[str], Tensor]
) -> None:
    """A ``torch.save`` file of the state dict ``layouts`` describes, written without holding
    it: torch saves the layout with room for every tensor's bytes
    (``torch.serialization.skip_data``), then each tensor is read and written in its place."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # seconds to import: pt alone

    with FakeTensorMode():
        skeleton = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in layouts.items()}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, path)
    placed = torch.load(path, map_location="meta", weights_only=True)
    with path.open("r+b") as handle:
        for name, layout in layouts.items():
            if layout.nbytes == 0:
                continue
            tensor = tensor_of(name)
            if TensorLayout.of(tensor) != layout:
                raise ExportError(f"{path}: {name} is {TensorLayout.of(tensor)}, not {layout}")
            handle.seek(placed[name].untyped_storage()._checkpoint_offset)  # noqa: SLF001
            handle.write(raw_bytes(tensor))
        handle.flush()
        os.fsync(handle.fileno())


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


def _write_hf(weights: Weights, config: dict[str, Any], folder: Path, max_bytes: int) -> None:
    """``config.json`` and the weights in safetensors shards, as ``save_pretrained`` lays them
    out."""
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
    write_shards(folder, weights.layouts, weights.tensor, max_bytes)
