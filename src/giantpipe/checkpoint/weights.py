"""The weights a run starts from (``trainer.init_from``), by name, from any file that holds
them: a giantpipe checkpoint (its EMA where it kept one), a ``torch.save`` state dict (mapped,
not read), a safetensors file or folder, a Hugging Face model folder. Opening reads only what
says where each tensor lies; a read touches only the tensors asked for.

Example::

    source = open_weights(Path("llama"))     # config.json + model-0000i-of-0000n.safetensors
    source.read(["model.layers.3.mlp.up_proj.weight"])      # that tensor's bytes alone
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from giantpipe.checkpoint.errors import CheckpointError
from giantpipe.checkpoint.load import open_tensors
from giantpipe.checkpoint.manifest import read_manifest, weight_names
from giantpipe.checkpoint.names import EMA, MANIFEST
from giantpipe.checkpoint.run import RUN_FORMAT
from giantpipe.checkpoint.safetensors_files import INDEX, SafetensorsFiles
from giantpipe.checkpoint.sources import HeldTensors, TensorLayout, TensorSource
from giantpipe.checkpoint.unpickling import safe_load

__all__ = ["Aliased", "PreferEma", "open_weights", "tied_names"]


class PreferEma:
    """A run checkpoint's weights: each parameter from the EMA where the run kept one (the
    weights it evaluated), buffers from the model."""

    def __init__(self, source: TensorSource, weights: list[str]) -> None:
        self.path, self.source, self.weights = source.path, source, weights
        self.ema = {n[len(EMA) :] for n in source.names() if n.startswith(EMA)}

    def names(self) -> list[str]:
        return list(self.weights)

    def layout(self, name: str) -> TensorLayout:
        return self.source.layout(self._stored(name))

    def read(
        self, names: Iterable[str], like: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        stored = {n: self._stored(n) for n in names}
        as_stored = {stored[n]: t for n, t in (like or {}).items() if n in stored}
        read = self.source.read(list(stored.values()), as_stored)
        return {n: read[s] for n, s in stored.items()}

    def _stored(self, name: str) -> str:
        return f"{EMA}{name}" if name in self.ema else name


class Aliased:
    """A source in which some names are others' (a Hugging Face model's output embedding tied
    to its input embedding, which its files keep once, under the input's name)."""

    def __init__(self, source: TensorSource, aliases: Mapping[str, str]) -> None:
        held = set(source.names())
        self.path, self.source = source.path, source
        self.aliases = {a: t for a, t in aliases.items() if a not in held and t in held}

    def names(self) -> list[str]:
        return self.source.names() + list(self.aliases)

    def layout(self, name: str) -> TensorLayout:
        return self.source.layout(self.aliases.get(name, name))

    def read(
        self, names: Iterable[str], like: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        stored = {n: self.aliases.get(n, n) for n in names}
        read = self.source.read(list(dict.fromkeys(stored.values())))
        return {n: read[s] for n, s in stored.items()}


def open_weights(path: Path) -> TensorSource:
    """The weights at ``path``, by name (only indices and headers read so far);
    CheckpointError naming ``path`` when it holds none giantpipe can read."""
    if path.is_dir():
        if (path / MANIFEST).is_file():
            return _checkpoint(path)
        if (path / INDEX).is_file() or any(path.glob("*.safetensors")):
            files = SafetensorsFiles.of(path)
            tied = tied_names(path) if (path / "config.json").is_file() else {}
            return Aliased(files, tied) if tied else files
        raise CheckpointError(
            path, f"holds no checkpoint ({MANIFEST}), no safetensors file, no Hugging Face model"
        )
    if not path.is_file():
        raise CheckpointError(path, "does not exist")
    with path.open("rb") as handle:
        head = handle.read(9)
    if path.suffix == ".safetensors" or head[8:] == b"{":  # 8 bytes of length, then JSON
        return SafetensorsFiles.of(path)
    return _state_dict(path)


def _checkpoint(path: Path) -> TensorSource:
    manifest = read_manifest(path)
    source = open_tensors(path)
    if (manifest.get("extra") or {}).get("format") == RUN_FORMAT:
        return PreferEma(source, weight_names(manifest))
    return source


def _state_dict(path: Path) -> TensorSource:
    """A ``torch.save`` file, mapped (``mmap``; a file of torch's old unzipped format is read
    whole): a state dict, or a one-file checkpoint of the earlier format (its EMA preferred)."""
    loaded: Any = safe_load(path, mmap=True)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("model"), Mapping):
        weights = dict(loaded["model"])
        if isinstance(loaded.get("ema"), Mapping):
            weights.update(loaded["ema"])
        loaded = weights
    if not isinstance(loaded, Mapping) or not loaded:
        raise CheckpointError(path, "holds no state dict (a name -> tensor mapping)")
    return HeldTensors(path, {str(k): v for k, v in loaded.items() if isinstance(v, Tensor)})


def tied_names(folder: Path) -> dict[str, str]:
    """A Hugging Face model folder's tied names (``lm_head.weight`` -> the input embedding's),
    from its ``config.json`` and the model built on meta (no memory, no weights); none where
    transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return {}
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(folder / "config.json", f"is not a readable config ({err})") from err
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {str(k): str(v) for k, v in dict(tied).items()}
