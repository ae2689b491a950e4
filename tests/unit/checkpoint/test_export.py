"""Export tensor by tensor: the streamed ``torch.save`` file is what torch.save writes, a folder
export is cut into safetensors shards with Hugging Face's index, and a size is read as
``save_pretrained`` reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from giantpipe.checkpoint.export import ExportError, export, parse_size, write_pt
from giantpipe.checkpoint.sources import TensorLayout
from tests.unit.checkpoint.saves import save

REPO = Path(__file__).resolve().parents[3]


def odd_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "0.weight": torch.randn(5, 3).to(torch.bfloat16),
        "0.steps": torch.tensor(7),  # 0-dim
        "1.mask": torch.rand(4) > 0.5,
        "1.index": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "2.empty": torch.empty(0, 4),
        "2.weight": torch.randn(2, 8)[:, ::2],  # not contiguous
    }


def test_a_streamed_pt_file_loads_as_torch_save_writes_it(tmp_path: Path) -> None:
    state = odd_tensors()
    layouts = {n: TensorLayout.of(t) for n, t in state.items()}
    write_pt(tmp_path / "model.pt", layouts, lambda name: state[name])
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "model.pt", weights_only=True, mmap=mmap)
        assert list(loaded) == list(state)
        for name, tensor in state.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_a_folder_export_is_cut_into_shards_with_the_index_hugging_face_writes(tmp_path):
    torch.manual_seed(0)
    state = {f"{i}.weight": torch.randn(256) for i in range(5)}  # 1 KiB each
    save(tmp_path / "ckpt", state)
    done = export(tmp_path / "ckpt", tmp_path / "out", "safetensors", max_shard_bytes=2048)
    assert done["tensors"] == 5 and done["bytes"] == 5 * 1024
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        *names,
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 5 * 1024}
    assert index["weight_map"] == {f"{i}.weight": names[i // 2] for i in range(5)}
    for file in names:
        for name, tensor in load_file(tmp_path / "out" / file).items():
            assert index["weight_map"][name] == file and torch.equal(tensor, state[name])
    export(tmp_path / "ckpt", tmp_path / "one", "safetensors")  # within the default size
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["model.safetensors"]


def test_a_size_is_read_as_save_pretrained_reads_it_and_a_bad_one_named(tmp_path) -> None:
    assert parse_size("2e3") == 2000 and parse_size("1KiB") == 1024 and parse_size("5gb") == 5e9
    for bad in ("five", "0", "-1GB", "3 parsecs"):
        with pytest.raises(ExportError, match=rf"--max-shard-size: '{bad}' is no size"):
            parse_size(bad)
    save(tmp_path / "ckpt", {"0.weight": torch.ones(2)})
    with pytest.raises(ExportError, match=r"--max-shard-size: .*model.pt is one file"):
        export(tmp_path / "ckpt", tmp_path / "model.pt", "pt", max_shard_bytes=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


PEAK = """
import json, sys
from torch._subclasses.fake_tensor import FakeTensorMode
from giantpipe.consolidate import main
from giantpipe.testing.held import peak_above_start

FakeTensorMode()  # the modules it brings are the process's, not the model's
print([peak_above_start(lambda: main(args))[1] for args in json.loads(sys.argv[1])])
"""


@pytest.mark.slow  # writes and exports checkpoints of 64 and 256 MiB in a fresh process
@pytest.mark.parametrize(("kind", "suffix", "shard"), [("pt", ".pt", 0), ("safetensors", "", 2)])
def test_an_exports_peak_memory_is_the_largest_tensor_not_the_model(tmp_path, kind, suffix, shard):
    """``python -m giantpipe.consolidate`` of four times the model, the same peak: it grows by
    less than two tensors where holding the model would grow it by twelve (a folder export is
    cut in shards of two tensors)."""
    tensor = 16 * 2**20
    exports = []
    for count in (4, 16):
        torch.manual_seed(count)
        save(
            tmp_path / f"ckpt{count}",
            {f"{i}.weight": torch.randn(tensor // 4) for i in range(count)},
        )
        args = [str(tmp_path / f"ckpt{count}"), str(tmp_path / f"out{count}{suffix}")]
        args += ["--format", kind] + (["--max-shard-size", str(shard * tensor)] if shard else [])
        exports.append(args)
    # both exports in one process, the smaller first (each peak from its own start: the larger
    # export finds nothing of the smaller's held)
    done = subprocess.run(
        [sys.executable, "-c", PEAK, json.dumps(exports)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": f"{REPO / 'src'}:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(peaks) == 2 and min(peaks) > 0, peaks
    assert peaks[1] - peaks[0] < 2 * tensor, peaks
    assert peaks[1] < 8 * tensor, peaks
