"""The earlier formats: each is still read, until the release that drops it; what is not a
checkpoint is one error naming the file."""

import json
from pathlib import Path

import pytest
import torch

import giantpipe
from giantpipe.checkpoint.earlier import READ_BEFORE, SHARDS_V1, SHARDS_V2
from giantpipe.checkpoint.errors import CheckpointDamaged, CheckpointError, MissingTensors
from giantpipe.checkpoint.files import describe
from giantpipe.checkpoint.load import load
from giantpipe.checkpoint.manifest import record_hash
from giantpipe.checkpoint.run import open_run
from tests.unit.checkpoint.saves import save, weights


def test_unreadable_or_foreign_checkpoint_is_one_error_naming_it(tmp_path: Path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt is not a readable checkpoint"):
        open_run(junk)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": 1}, foreign)
    with pytest.raises(CheckpointError, match="foreign.pt is not a giantpipe checkpoint"):
        open_run(foreign)
    with pytest.raises(CheckpointError, match="absent.pt holds no checkpoint"):
        open_run(tmp_path / "absent.pt")


def test_the_earlier_format_still_loads_and_a_bad_file_there_is_named(tmp_path: Path) -> None:
    shard = tmp_path / "step000000002-3f9c2a-rank00000.pt"
    torch.save(weights(), shard)
    entries = [{"file": shard.name, "rank": 0, "stages": [0], "names": list(weights())}]
    manifest = {"format": SHARDS_V1, "step": 2, "balance": [3], "shards": entries}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert all(torch.equal(load(tmp_path)[k], v) for k, v in weights().items())
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointDamaged, match=rf"^{shard} is damaged \(torch cannot read it"):
        load(tmp_path)


def test_a_one_file_checkpoint_is_read_under_todays_names(tmp_path: Path) -> None:
    w = weights()
    state = {
        "format_version": 1,
        "step": 3,
        "position": 12,
        "balance": [2, 1],
        "model": w,
        "optimizer": {
            "state": {"0.weight": {"step": 3, "exp_avg": torch.full((32, 32), 0.5)}},
            "param_groups": [{"lr": 0.1, "params": ["0.weight"]}],
        },
        "scheduler": {"last_epoch": 3},
        "ema": {"0.weight": torch.ones(32, 32)},
        "rng": {"torch": torch.get_rng_state()},
    }
    torch.save(state, tmp_path / "last.pt")
    run = open_run(tmp_path / "last.pt")
    assert (run.step, run.position, run.ema, run.balance, run.workers) == (3, 12, True, [2, 1], 2)
    assert run.weights == list(w) and run.ranks == 1 and run.leaders == [0]
    read = run.tensors.read(["0.bias", "optimizer/0.weight/exp_avg", "ema/0.weight"])
    assert torch.equal(read["0.bias"], w["0.bias"])
    assert torch.equal(read["optimizer/0.weight/exp_avg"], torch.full((32, 32), 0.5))
    assert torch.equal(read["ema/0.weight"], torch.ones(32, 32))
    assert run.leader_states()[0]["scheduler"] == {"last_epoch": 3}
    with pytest.raises(MissingTensors, match="last.pt holds no tensor 9.weight"):
        run.tensors.read(["9.weight"])


def test_every_earlier_format_is_read_until_the_release_that_drops_it() -> None:
    """Past READ_BEFORE this fails: remove the earlier readers (checkpoint/earlier.py), their
    tests and docs/checkpoints.md#earlier-formats, as that section promised."""
    now = tuple(int(part) for part in giantpipe.__version__.split(".")[:3])
    until = tuple(int(part) for part in READ_BEFORE.split("."))
    assert now < until, f"giantpipe {giantpipe.__version__} no longer reads the earlier formats"
    documented = (Path(__file__).parents[3] / "docs" / "checkpoints.md").read_text()
    assert f"every giantpipe release before {READ_BEFORE}" in documented


def test_a_save_whose_data_files_were_hashed_whole_is_checked_whole(tmp_path: Path) -> None:
    """giantpipe-shards/2 hashed each data file whole: it still loads, and a damaged byte
    anywhere in a file it reads is refused, as that format promised."""
    token = save(tmp_path, weights())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    data = f"{token}/__0_0.distcp"
    manifest["files"][data] = describe(tmp_path / token, ["__0_0.distcp"])["__0_0.distcp"]
    manifest["format"] = SHARDS_V2
    del manifest["block_bytes"]
    manifest["record"] = record_hash(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert torch.equal(load(tmp_path, ["2.weight"])["2.weight"], weights()["2.weight"])
    path = tmp_path / data
    raw = bytearray(path.read_bytes())
    at = bytes(raw).find(weights()["0.weight"].numpy().tobytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointDamaged, match=r"__0_0.distcp is damaged \(content hash differs"):
        load(tmp_path, ["2.weight"])
