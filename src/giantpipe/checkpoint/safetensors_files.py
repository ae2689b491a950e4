"""safetensors files: read by name (only a file's header, then only the asked tensors' bytes),
and written tensor by tensor, one file or shards with an index as Hugging Face lays them out
(``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``).

Example::

    source = SafetensorsFiles.of(Path("llama"))       # model.safetensors, or the index
    source.read(["model.embed_tokens.weight"])        # that tensor's bytes alone
    write_shards(Path("out"), layouts, tensor_of, max_bytes=5 * 10**9)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from giantpipe.checkpoint.errors import CheckpointDamaged, CheckpointError, MissingTensors
from giantpipe.checkpoint.sources import TensorLayout

__all__ = [
    "INDEX",
    "SINGLE",
    "SafetensorsFiles",
    "plan_shards",
    "raw_bytes",
    "read_header",
    "write_file",
    "write_shards",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""torch's dtypes under the names the safetensors format gives them."""
LARGEST_HEADER = 100 * 2**20
"""safetensors' own limit on a header's size."""


class SafetensorsFiles:
    """Tensors of one or more safetensors files, read by name: each file's header says where
    its tensors lie, and a read touches only the asked tensors' bytes (``safe_open``)."""

    def __init__(self, path: Path, headers: Mapping[Path, Mapping[str, TensorLayout]]) -> None:
        self.path = path
        self.where = {name: file for file, held in headers.items() for name in held}
        self.layouts = {name: t for held in headers.values() for name, t in held.items()}

    @classmethod
    def of(cls, path: Path) -> SafetensorsFiles:
        """A ``.safetensors`` file, or a folder: the files its ``model.safetensors.index.json``
        names, else every ``*.safetensors`` in it (only their headers read)."""
        if path.is_file():
            return cls(path, {path: read_header(path)})
        files = sorted(path.glob("*.safetensors"))
        if (path / INDEX).is_file():
            files = _indexed(path / INDEX)
        if not files:
            raise CheckpointError(path, "holds no safetensors file")
        return cls(path, {file: read_header(file) for file in files})

    def names(self) -> list[str]:
        return list(self.where)

    def layout(self, name: str) -> TensorLayout:
        if name not in self.layouts:
            raise MissingTensors(self.path, [name])
        return self.layouts[name]

    def read(
        self, names: Iterable[str], like: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        from safetensors import safe_open

        wanted = list(names)
        missing = [n for n in wanted if n not in self.where]
        if missing:
            raise MissingTensors(self.path, missing)
        found: dict[str, Tensor] = {}
        for file in sorted({self.where[n] for n in wanted}):
            try:
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    found.update({n: handle.get_tensor(n) for n in wanted if self.where[n] == file})
            except Exception as err:  # safetensors' own error is neither OSError nor ValueError
                raise CheckpointDamaged(file, f"not a readable safetensors file: {err}") from err
        return {n: found[n] for n in wanted}


def read_header(path: Path) -> dict[str, TensorLayout]:
    """Name -> dtype and shape, from a safetensors file's header alone; CheckpointDamaged
    naming the file when the header cannot be read.

    Example::

        read_header(Path("llama/model.safetensors"))["lm_head.weight"].shape   # (32000, 4096)
    """
    names = {code: dtype for dtype, code in DTYPES.items()}
    try:
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > min(LARGEST_HEADER, path.stat().st_size - 8):
                raise ValueError(f"its length field says {size} bytes")
            header = json.loads(handle.read(size))
        return {
            name: TensorLayout(names[entry["dtype"]], tuple(int(n) for n in entry["shape"]))
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except FileNotFoundError as err:
        raise CheckpointError(path, "is missing") from err
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as err:
        raise CheckpointDamaged(path, f"not a readable safetensors header: {err}") from err


def _indexed(index: Path) -> list[Path]:
    """The files a Hugging Face ``model.safetensors.index.json`` names, in order."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return [index.parent / str(f) for f in dict.fromkeys(weight_map.values())]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointDamaged(index, f"not a readable index: {err}") from err


def plan_shards(
    layouts: Mapping[str, TensorLayout], max_bytes: int
) -> list[dict[str, TensorLayout]]:
    """Tensors in order, cut into shards of at most ``max_bytes`` (a larger tensor alone), as
    ``save_pretrained`` cuts them.

    >>> t = {n: TensorLayout(torch.float32, (10,)) for n in "abc"}
    >>> [list(s) for s in plan_shards(t, 80)]
    [['a', 'b'], ['c']]
    """
    shards: list[dict[str, TensorLayout]] = [{}]
    size = 0
    for name, layout in layouts.items():
        if shards[-1] and size + layout.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = layout
        size += layout.nbytes
    return shards


def write_file(
    path: Path, layouts: Mapping[str, TensorLayout], tensor_of: Callable[[str], Tensor]
) -> None:
    """One safetensors file of ``layouts``: the header first (it needs only names, dtypes and
    shapes), then each tensor fetched (``tensor_of``), written and let go before the next."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # what HF's loaders expect
    start = 0
    for name, layout in layouts.items():
        if layout.dtype not in DTYPES:
            raise CheckpointError(path, f"cannot hold {name}: safetensors has no {layout.dtype}")
        header[name] = {
            "dtype": DTYPES[layout.dtype],
            "shape": list(layout.shape),
            "data_offsets": [start, start + layout.nbytes],
        }
        start += layout.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        for name, layout in layouts.items():
            tensor = tensor_of(name)
            if TensorLayout.of(tensor) != layout:
                raise CheckpointError(path, f"{name} is {TensorLayout.of(tensor)}, not {layout}")
            handle.write(raw_bytes(tensor))


def raw_bytes(tensor: Tensor) -> memoryview:
    """A tensor's bytes in row-major order, on the host (no copy where it is contiguous there).

    >>> bytes(raw_bytes(torch.tensor([1, 2], dtype=torch.int16)))
    b'\\x01\\x00\\x02\\x00'
    """
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def write_shards(
    folder: Path,
    layouts: Mapping[str, TensorLayout],
    tensor_of: Callable[[str], Tensor],
    max_bytes: int,
) -> list[Path]:
    """``model.safetensors`` in ``folder``, or, when the tensors exceed ``max_bytes``,
    ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``."""
    shards = plan_shards(layouts, max_bytes)
    if len(shards) == 1:
        write_file(folder / SINGLE, shards[0], tensor_of)
        return [folder / SINGLE]
    count = len(shards)
    files = [folder / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for file, shard in zip(files, shards, strict=True):
        write_file(file, shard, tensor_of)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in layouts.values())},
        "weight_map": {
            name: f.name for f, shard in zip(files, shards, strict=True) for name in shard
        },
    }
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*files, folder / INDEX]
