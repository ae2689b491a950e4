"""``python -m giantpipe.consolidate RUN/last OUT --format pt|safetensors|hf``: one file for the
plain model, or a directory Hugging Face's ``from_pretrained`` loads; a bad input is one line
naming the path, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.consolidate import main
from giantpipe.runner import train
from giantpipe.runner.build import build_experiment
from giantpipe.runner.run_state.restore import restore
from giantpipe.runner.world import World
from giantpipe.testing.reference import plain_model
from tests.support.runs import tiny


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("consolidate") / "run"
    train(tiny(max_steps=2, eval_every=0), run_dir, "")
    return run_dir


def test_safetensors_holds_the_plain_models_state_dict(mlp_run: Path, tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    assert main([str(mlp_run / "last"), str(tmp_path / "model.pt"), "--format", "pt"]) == 0
    out = tmp_path / "weights.safetensors"
    assert main([str(mlp_run / "last"), str(out), "--format", "safetensors"]) == 0
    model = plain_model(tiny())
    model.load_state_dict(safetensors.load_file(out))  # strict: every name, no extra
    pt = torch.load(tmp_path / "model.pt", weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, pt[name]), name


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("missing", "{run}/nowhere/manifest.json: no checkpoint there"),
        ("damaged", "{run}/last/{folder}/.metadata is damaged (truncated: 3 of "),
        ("format", "--format: unknown format 'onnx'; choose pt, safetensors or hf"),
        ("exists", "{out} exists; nothing was overwritten (choose a new path)"),
        ("not hf", "--format hf: {run}/last holds a model built by models.mlp.mlp, not one "),
    ],
)
def test_a_bad_input_is_one_line_naming_the_path_and_nothing_is_written(
    case: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    train(tiny(max_steps=1, eval_every=0), run_dir, "")
    (folder,) = [p.name for p in (run_dir / "last").iterdir() if p.is_dir()]
    out = tmp_path / "out.pt"
    args = [str(run_dir / "last"), str(out)]
    if case == "missing":
        args[0] = str(run_dir / "nowhere")
    if case == "damaged":
        (run_dir / "last" / folder / ".metadata").write_bytes(b"abc")
    if case == "format":
        args += ["--format", "onnx"]
    if case == "exists":
        out.write_text("keep me")
    if case == "not hf":
        args[1] = str(tmp_path / "hf")
        args += ["--format", "hf"]
    assert main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("consolidate: " + said.format(run=run_dir, folder=folder, out=out))
    assert not (tmp_path / "hf").exists()
    assert out.read_text() == "keep me" if case == "exists" else not out.exists()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["out.pt", "run"] if case == "exists" else ["run"])  # no temporary either


@pytest.mark.slow
def test_a_hugging_face_llama_exports_as_a_directory_from_pretrained_loads(tmp_path) -> None:
    """A sequentialized Llama trained two steps by the runner, exported with --format hf (one
    file, and cut into shards with an index), gives the pipelined model's logits through
    AutoModelForCausalLM.from_pretrained."""
    transformers = pytest.importorskip("transformers")
    from tests.support.runs import llama_config

    cfg = llama_config()
    train(cfg, tmp_path / "run", "")
    parts = build_experiment(cfg)
    restore(parts, tmp_path / "run" / "last", World())
    parts.pipe.eval()
    ids, _ = next(parts.bundle.train_batches(0, 0))
    out, shards = tmp_path / "llama", tmp_path / "sharded"
    assert main([str(tmp_path / "run" / "last"), str(out), "--format", "hf"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    last = str(tmp_path / "run" / "last")
    assert main([last, str(shards), "--format", "hf", "--max-shard-size", "20KB"]) == 0
    files = sorted(p.name for p in shards.glob("model-*-of-*.safetensors"))
    assert len(files) > 1 and (shards / "model.safetensors.index.json").is_file()
    for folder in (out, shards):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(hf).__name__ == "LlamaForCausalLM"
        with torch.no_grad():
            assert torch.equal(hf(input_ids=ids).logits, parts.pipe(ids)), folder
