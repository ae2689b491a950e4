"""Load by share at K = 4 over gloo: each rank reads from disk only its share of a Hugging Face
folder (safetensors shards) and of a giantpipe checkpoint one process wrote (one DCP file,
checked by block), and gets what a whole load gets; ``trainer.init_from`` under torchrun trains
as the local executor does from the same weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from giantpipe.checkpoint.export import export
from giantpipe.checkpoint.files import BLOCK
from giantpipe.checkpoint.weights import open_weights
from giantpipe.cli.checks import to_experiment
from giantpipe.cli.registration import register_configs
from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from giantpipe.testing.reads import (
    Layouts,
    digest,
    disk_bytes_read,
    drop_cache,
    pipeline_shares,
    read_ahead_bytes,
)
from tests.support.ranks import REPO, finish, spawn
from tests.support.train import train_under_torchrun
from tests.unit.checkpoint.saves import save

pytestmark = pytest.mark.distributed

K = 4
READ_AHEAD = read_ahead_bytes()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Llama of about 470 MiB saved as Hugging Face does, in 100 MB shards."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        shapes = transformers.LlamaForCausalLM(config).state_dict()
    torch.manual_seed(0)
    state = {n: torch.randn(t.shape) for n, t in shapes.items()}
    folder = tmp_path_factory.mktemp("share") / "llama"
    model = transformers.LlamaForCausalLM(config)  # save_pretrained's own files
    model.load_state_dict(state)
    model.save_pretrained(folder, max_shard_size="100MB")
    return folder, state


def shares(state: dict[str, torch.Tensor]) -> list[Layouts]:
    """Each of K pipeline ranks' names, with their dtypes and shapes."""
    return [
        {n: (state[n].dtype, tuple(state[n].shape)) for n in names}
        for names in pipeline_shares(list(state), K)
    ]


def check_shares(
    source: Path, state: dict[str, torch.Tensor], tmp: Path, slack: Callable[[list[str]], int]
) -> None:
    """K ranks read their shares of ``source``: each reads from disk its share and at most
    ``slack(its names)`` more, and gets what a whole load gets."""
    parts = shares(state)
    results = spawn(
        "tests.distributed.share_workers:read_share_of",
        world=K,
        tmp=tmp,
        timeout=300,
        source=str(source),
        shares=parts,
    )
    whole = sum(t.nbytes for t in state.values())
    if sum(r["read"] for r in results) < whole / 2:
        pytest.skip("this file system keeps no page cache to drop: nothing counts as read")
    for rank, result in enumerate(results):
        share = sum(state[n].nbytes for n in parts[rank])
        assert result["share"] == share, rank
        extra = slack(list(parts[rank]))
        assert result["read"] <= share + extra, (rank, result["read"], share)  # not the rest
        for name, found in result["digests"].items():  # what a whole load gets
            assert found == digest(state[name]), name


def test_each_rank_reads_only_its_share_of_a_hugging_face_folder(llama, tmp_path) -> None:
    folder, state = llama
    where = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    # read-ahead on both sides of the share's bytes in each file it lies in
    check_shares(
        folder, state, tmp_path, lambda names: 2 * READ_AHEAD * len({where[n] for n in names})
    )
    drop_cache(folder)  # against it: one process reading the whole folder
    before = disk_bytes_read()
    source = open_weights(folder)
    source.read(source.names())
    assert disk_bytes_read() - before >= 0.75 * sum(t.nbytes for t in state.values())


def test_each_rank_reads_only_its_share_of_a_checkpoint_one_process_wrote(llama, tmp_path):
    _, state = llama
    save(tmp_path / "ckpt", state)  # one DCP file: the ranks' shares lie in one file
    # one block checked, and read ahead, on both sides of the share's bytes
    check_shares(tmp_path / "ckpt", state, tmp_path / "ranks", lambda _: 2 * (BLOCK + READ_AHEAD))


OVERRIDES = [
    "recipe=mlp_quickstart",
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "data.train_size=256",
    "data.eval_size=64",
    "logger.progress=none",
]


def local_run(run_dir: Path, *extra: str) -> list[float]:
    """The job with the local executor, in this process: the loss of every step."""
    register_configs(REPO / "conf")
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = to_experiment(compose("config", [*OVERRIDES, *extra]))
    train(cfg, run_dir, "local\n")
    return losses(run_dir)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def test_init_from_under_torchrun_trains_as_the_local_executor(tmp_path: Path) -> None:
    """Weights in safetensors shards (another run's, exported): two ranks each read their
    stage's and train as one process holding both does, step by step."""
    local_run(tmp_path / "pretrained", "trainer.seed=1")
    weights = tmp_path / "weights"
    exported = export(tmp_path / "pretrained" / "last", weights, "safetensors", 2**12)
    assert exported["tensors"] > 1 and len(list(weights.glob("model-*.safetensors"))) > 1
    init = f"trainer.init_from={weights}"
    expected = local_run(tmp_path / "local", init)
    assert expected[0] != local_run(tmp_path / "fresh")[0]  # the weights were loaded
    proc = train_under_torchrun(tmp_path / "dist", *OVERRIDES, init, timeout=30)
    code, output = finish(proc, timeout=180)
    assert code == 0, output
    assert losses(tmp_path / "dist") == pytest.approx(expected, rel=1e-5)
