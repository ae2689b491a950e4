"""Checkpoint storage on DCP in one process: every file checked against the manifest's hash,
a manifest that checks itself, DCP's metadata unpickled without running code, and only
giantpipe's own leftovers removed."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint import files
from giantpipe.checkpoint import save as save_module
from giantpipe.checkpoint.errors import CheckpointDamaged
from giantpipe.checkpoint.export import consolidate
from giantpipe.checkpoint.files import block_record, describe, file_digest
from giantpipe.checkpoint.load import load
from giantpipe.checkpoint.manifest import FORMAT, read_manifest, record_hash
from tests.unit.checkpoint.saves import save, weights


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, at + 4):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_save_loads_back_and_names_every_file_with_its_hash(tmp_path: Path) -> None:
    token = save(tmp_path, weights())
    manifest = read_manifest(tmp_path)
    assert manifest["folder"] == token and manifest["format"] == FORMAT
    assert sorted(manifest["files"]) == [f"{token}/.metadata", f"{token}/__0_0.distcp"]
    data = tmp_path / token / "__0_0.distcp"
    assert manifest["files"][f"{token}/__0_0.distcp"] == block_record(data)
    metadata = tmp_path / token / ".metadata"
    assert manifest["files"][f"{token}/.metadata"]["sha256"] == file_digest(metadata)
    loaded = load(tmp_path)
    assert loaded.keys() == weights().keys()
    assert all(torch.equal(loaded[k], v) for k, v in weights().items())
    assert load(tmp_path, ["2.weight"]).keys() == {"2.weight"}


def test_a_flipped_byte_a_truncated_or_a_missing_file_is_refused_naming_it(tmp_path) -> None:
    token = save(tmp_path, weights())
    data = tmp_path / token / "__0_0.distcp"
    original = data.read_bytes()
    flip(data, original.find(weights()["0.weight"].numpy().tobytes()) + 64)
    with pytest.raises(CheckpointDamaged, match=rf"^{data} is damaged \(content hash differs"):
        load(tmp_path)
    data.write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointDamaged, match=rf"{data} is damaged \(truncated: \d+ of"):
        load(tmp_path)
    data.unlink()
    with pytest.raises(CheckpointDamaged, match=rf"{data} is damaged \(missing\)"):
        consolidate(tmp_path, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


def test_a_manifest_changed_after_it_was_written_is_refused(tmp_path: Path) -> None:
    save(tmp_path, weights(), step=40)
    path = tmp_path / "manifest.json"
    path.write_text(path.read_text().replace('"step": 40', '"step": 41'))
    with pytest.raises(CheckpointDamaged, match="manifest.json is damaged .*its own hash"):
        read_manifest(tmp_path)
    path.write_text("x" + path.read_text()[1:])
    with pytest.raises(CheckpointDamaged, match="manifest.json is damaged .not valid JSON"):
        load(tmp_path)


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    token = save(tmp_path / "ckpt", weights())
    marker = tmp_path / "ran"
    metadata = tmp_path / "ckpt" / token / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    # Whoever crafts the file can fix the manifest's hashes too: the allow-list must hold.
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    manifest["files"][f"{token}/.metadata"] = describe(metadata.parent, [".metadata"])[".metadata"]
    manifest["record"] = record_hash(manifest)
    (tmp_path / "ckpt" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointDamaged, match=r"holds posix\.system, which DCP's metadata never"):
        load(tmp_path / "ckpt")
    assert not marker.exists()


def test_a_commit_removes_the_previous_save_and_only_what_giantpipe_wrote(tmp_path) -> None:
    first = save(tmp_path, weights(), step=1)
    foreign = tmp_path / "step000000007-abcdef"  # our name, someone else's content
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "notes.tmp").write_text("mine")
    second = save(tmp_path, weights(), step=2)
    assert not (tmp_path / first).exists() and (tmp_path / second).is_dir()
    assert (foreign / "notes.txt").exists() and (tmp_path / "notes.tmp").exists()

    # An unreadable manifest may name any folder: the next commit removes none of them.
    path = tmp_path / "manifest.json"
    path.write_text(path.read_text()[:-5])
    third = save(tmp_path, weights(), step=3)
    assert (tmp_path / second).is_dir() and (tmp_path / third).is_dir()
    assert read_manifest(tmp_path)["folder"] == third


def test_data_files_are_hashed_as_written_never_read_back(tmp_path, monkeypatch) -> None:
    read_back: list[str] = []
    real_blocks, real_digest = save_module.block_record, files.file_digest

    def blocks(path: Path) -> dict:
        read_back.append(path.name)
        return real_blocks(path)

    def digest(path: Path) -> str:
        read_back.append(path.name)
        return real_digest(path)

    monkeypatch.setattr(save_module, "block_record", blocks)  # what the writer calls
    monkeypatch.setattr(files, "file_digest", digest)
    token = save(tmp_path, weights())
    assert read_back == [".metadata"]  # the small index; the tensors' file hashed on its way
    recorded = read_manifest(tmp_path)["files"][f"{token}/__0_0.distcp"]
    assert recorded == real_blocks(tmp_path / token / "__0_0.distcp")


def test_a_read_checks_and_reads_only_the_blocks_it_touches(tmp_path, monkeypatch) -> None:
    """A rank reading its share of a file another layout wrote reads little more than its
    share: a damaged byte elsewhere in the file goes unread (and unnoticed), one in a tensor
    it reads is refused."""
    monkeypatch.setattr(files, "BLOCK", 2**16)  # 64 KiB blocks, for tensors of 64 KiB
    monkeypatch.setattr(save_module, "BLOCK", 2**16)
    tensors = {f"{i}.weight": torch.full((2**14,), float(i)) for i in range(8)}
    token = save(tmp_path, tensors)
    data = tmp_path / token / "__0_0.distcp"
    flip(data, data.read_bytes().find(tensors["7.weight"].numpy().tobytes()) + 100)
    before = bytes_read()
    first = load(tmp_path, ["0.weight"])
    assert bytes_read() - before < data.stat().st_size / 2
    assert torch.equal(first["0.weight"], tensors["0.weight"])
    with pytest.raises(CheckpointDamaged, match=rf"^{data} is damaged \(content hash differs"):
        load(tmp_path, ["7.weight"])


def bytes_read() -> int:
    """This process's bytes read through read() so far (``rchar``, the page cache included)."""
    lines = Path("/proc/self/io").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith("rchar:"))
