"""The weights a run starts from, by name from any file that holds them: a safetensors file or
folder, a Hugging Face model folder (sharded, tied), a state dict, a giantpipe checkpoint (its
EMA preferred); only the asked tensors come back, and a damaged header is one error naming it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from giantpipe.checkpoint.errors import CheckpointDamaged, CheckpointError, MissingTensors
from giantpipe.checkpoint.weights import open_weights
from tests.unit.checkpoint.saves import save, weights


def tiny_llama(tie: bool) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_safetensors_file_gives_the_asked_tensors_alone(tmp_path: Path) -> None:
    save_file(weights(), tmp_path / "w.safetensors")
    source = open_weights(tmp_path / "w.safetensors")
    assert set(source.names()) == set(weights())
    assert source.layout("0.weight").shape == (32, 32)
    read = source.read(["2.weight"])
    assert list(read) == ["2.weight"] and torch.equal(read["2.weight"], weights()["2.weight"])
    with pytest.raises(MissingTensors, match=r"w.safetensors holds no tensor 9.weight"):
        source.read(["9.weight"])


@pytest.mark.parametrize("tie", [False, True])
def test_a_hugging_face_folder_in_shards_reads_as_from_pretrained_does(tmp_path, tie) -> None:
    model = tiny_llama(tie)
    model.save_pretrained(tmp_path / "llama", max_shard_size="20KB")
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()  # several files
    source = open_weights(tmp_path / "llama")
    expected = model.state_dict()
    assert set(source.names()) == set(expected)  # lm_head.weight too, where it is tied
    layer = [n for n in expected if n.startswith("model.layers.1.")]
    read = source.read([*layer, "lm_head.weight"])
    assert set(read) == {*layer, "lm_head.weight"}
    for name, tensor in read.items():
        assert torch.equal(tensor, expected[name]), name


def test_a_state_dict_file_and_the_earlier_one_file_format_prefer_the_ema(tmp_path) -> None:
    torch.save(weights(), tmp_path / "plain.pt")
    assert torch.equal(
        open_weights(tmp_path / "plain.pt").read(["0.bias"])["0.bias"], weights()["0.bias"]
    )
    ema = {"0.weight": torch.ones(32, 32)}
    torch.save({"model": weights(), "ema": ema, "step": 3}, tmp_path / "last.pt")
    read = open_weights(tmp_path / "last.pt").read(["0.weight", "0.bias"])
    assert torch.equal(read["0.weight"], ema["0.weight"])  # the parameters the run evaluated
    assert torch.equal(read["0.bias"], weights()["0.bias"])


def test_a_giantpipe_checkpoint_of_weights_reads_by_name(tmp_path: Path) -> None:
    save(tmp_path / "ckpt", weights())
    source = open_weights(tmp_path / "ckpt")
    assert set(source.names()) == set(weights())
    assert torch.equal(source.read(["2.weight"])["2.weight"], weights()["2.weight"])


def test_a_damaged_header_or_nothing_to_read_is_one_error_naming_the_file(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(weights(), path)
    raw = bytearray(path.read_bytes())
    raw[8:12] = b"\x00\xff\x00\xff"  # the JSON header's first bytes
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointDamaged, match=rf"^{path} is damaged \(not a readable safe"):
        open_weights(path)
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")  # a length beyond the file
    with pytest.raises(CheckpointDamaged, match=rf"^{path} is damaged"):
        open_weights(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty holds no checkpoint"):
        open_weights(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="absent.pt does not exist"):
        open_weights(tmp_path / "absent.pt")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors is missing"):
        open_weights(tmp_path / "index")
