"""The Transformer recipes through the runner: composition, translation runs, resume, errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir

from giantpipe.cli.checks import to_experiment
from giantpipe.cli.registration import register_configs
from giantpipe.config import ExperimentConfig
from giantpipe.data.translation.generated import write_synthetic_corpus
from giantpipe.engine.rng import install_rng_hooks
from giantpipe.runner import train as train_in_process
from giantpipe.runner.build import build_experiment
from giantpipe.runner.model import build_model
from giantpipe.runner.step import accumulate_gradients
from giantpipe.testing import accumulate_micro_batches, step_seed
from giantpipe.testing.reference import plain_model
from models.transformer import count_parameters, label_smoothed_cross_entropy
from tests import tiny
from tests.support.train import REPO, ok
from tests.support.train import train as run_train

CONF = REPO / "conf"
register_configs(CONF)

TINY = [*tiny.TRANSLATION, "trainer.log_every=1"]


def train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python train.py ARGS`` (tests/support/train.py) with OpenMP threads that sleep while
    they wait: on a shared, oversubscribed 2-core machine spinning threads make each tiny op of
    a T(1, 32, 2) take milliseconds (measured: greedy decoding 6.4 s -> 0.04 s)."""
    return run_train(*args, cwd=cwd, timeout=300, env={"OMP_WAIT_POLICY": "PASSIVE"})


def composed(*overrides: str) -> ExperimentConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_experiment(compose("config", overrides=list(overrides)))


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """train.py: a 2-step run resumed in its own directory to step 4 (evaluations at 2 and 4);
    in process: the same 4 steps unbroken (BLEU off: it does not change the training)."""
    root = tmp_path_factory.mktemp("translation")
    part, full = root / "part", root / "full"
    steps = ("trainer.eval_every=2", f"hydra.run.dir={part}")
    ok(train(*TINY, "trainer.max_steps=2", *steps, cwd=root))
    spm = part / "spm.model"
    before = (spm.read_bytes(), spm.stat().st_mtime_ns)
    resumed = ok(train(*TINY, "trainer.max_steps=4", "trainer.resume=true", *steps, cwd=root))
    (root / "resume.out").write_text(resumed.stdout + resumed.stderr)
    assert (spm.read_bytes(), spm.stat().st_mtime_ns) == before, "resume retrained spm.model"
    unbroken = composed(
        *TINY,
        "trainer.max_steps=4",
        "data.bleu_sentences=0",
        "sweep.objective=eval/loss",  # the recipe's eval/bleu is not reported without BLEU
        "logger.progress=none",
    )
    train_in_process(unbroken, full, "# unbroken\n")
    return {"root": root, "full": full, "part": part}


def test_every_transformer_recipe_composes_with_its_paper_setting() -> None:
    quick = composed("recipe=transformer_quickstart")
    assert (quick.pipeline.devices, quick.pipeline.num_devices) == ("cpu", 2)
    assert quick.data.train_files is None  # the generated corpus
    paper = composed("recipe=transformer_translation")
    m = paper.model
    assert (m.num_layers, m.ffn_dim, m.num_heads, m.d_model) == (24, 8192, 16, 1024)
    assert paper.pipeline.num_devices == 4 and paper.optim.lr_schedule.name == "inverse_sqrt"
    assert (m.ffn_init_scale, m.logit_clip) == ("linear", 20.0)
    assert paper.data.min_sentences == paper.pipeline.chunks
    lm = composed("recipe=transformer_lm_scaling", "model.num_layers=48", "pipeline.num_devices=8")
    assert (lm.model.num_layers, lm.pipeline.num_devices, lm.data.seq_len) == (48, 8, 1024)
    with torch.device("meta"):
        assert count_parameters(build_model(lm).layers) == 50_358_272 * 48 + 131_072_000


@pytest.mark.slow
def test_translation_without_data_files_stops_with_one_line(tmp_path: Path) -> None:
    result = train("recipe=transformer_translation", cwd=tmp_path)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: data.train_files: data/translation/train.tsv not found")
    assert "recipe=transformer_quickstart" in lines[0]


@pytest.mark.slow
def test_run_writes_tokens_per_s_and_bleu(runs) -> None:
    full = runs["part"]  # trained to step 4 over two commands
    train_lines = records(full, "train")
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4]
    assert all(r["tokens_per_s"] > 0 for r in train_lines)
    evals = records(full, "eval")
    assert [r["step"] for r in evals] == [2, 4]
    for line in evals:
        assert 0.0 <= line["bleu"] <= 100.0 and line["decode_tokens_per_s"] > 0
        assert {"bleu/en-xa", "bleu/xa-en", "bleu/en-xb", "bleu/xb-en", "bleu_copy"} <= set(line)
    summary = json.loads((full / "summary.json").read_text())
    assert summary["train/tokens_per_s"] > 0 and "eval/bleu/xb-en" in summary
    assert "version:" in summary["eval/bleu_signature"]
    assert (full / "spm.model").is_file() and (full / "corpus" / "train.tsv").is_file()


@pytest.mark.slow
def test_resume_reuses_the_vocabulary_and_continues_the_same_batches(runs) -> None:
    assert "vocabulary: reusing" in (runs["root"] / "resume.out").read_text()
    full = {r["step"]: r["loss"] for r in records(runs["full"], "train")}
    resumed = {r["step"]: r["loss"] for r in records(runs["part"], "train")}
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5)


@pytest.mark.slow
def test_pipelined_k3_m4_always_dropout_matches_plain_on_real_batches(tmp_path: Path) -> None:
    cfg = composed(
        *TINY, "pipeline.num_devices=3", "pipeline.recompute=always", "model.dropout=0.2"
    )
    pipelined_steps_equal_plain(cfg, 3, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 1])
def test_tied_embeddings_train_pipelined_as_the_plain_model(tmp_path: Path, devices: int) -> None:
    # The softmax reuses the embedding table: layers 0 and 3 hold one parameter, on two stages
    cfg = composed(*TINY, "model.tie_embeddings=true", f"pipeline.num_devices={devices}")
    pipe = pipelined_steps_equal_plain(cfg, devices, tmp_path)
    assert pipe[0].tgt_tokens.weight is pipe[-1].proj.weight  # CPU stand-ins: one object


def smoothed(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The recipes' loss: label-smoothed cross-entropy summed over tokens (padding left out)."""
    return label_smoothed_cross_entropy(logits, target, epsilon=0.1)[0]


def tokens(target: torch.Tensor) -> int:
    return int(target.ne(0).sum())


def pipelined_steps_equal_plain(cfg: ExperimentConfig, devices: int, tmp_path: Path) -> Any:
    """Two steps of the runner's pipe equal the plain model's (loss and every gradient)."""
    torch.manual_seed(0)
    parts = build_experiment(cfg, run_dir=tmp_path)
    plain = plain_model(cfg, parts.bundle)
    plain.load_state_dict(parts.pipe.state_dict())
    handles = install_rng_hooks(plain)
    for position, batch in zip(range(2), parts.bundle.train_batches(0, 0)):  # lengths change
        inputs, target = batch
        reference = 0.0
        seed = step_seed(100 + position)
        for part in accumulate_micro_batches(plain, inputs, target, 4, seed, smoothed, tokens):
            reference += part.item()
        torch.manual_seed(100 + position)
        loss, _ = accumulate_gradients(
            parts.pipe, [batch], parts.loss_fn, parts.bundle.loss_normalizer, "fp32",
            ["cpu"] * devices,
        )  # fmt: skip
        assert loss == pytest.approx(reference, rel=1e-5)
    for h in handles:
        h.remove()
    pairs = list(zip(parts.pipe.named_parameters(), plain.named_parameters(), strict=True))
    for (name, p), (_, q) in pairs:
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    return parts.pipe


@pytest.mark.slow
def test_lm_scaling_recipe_runs_a_tiny_transformer_l(tmp_path: Path) -> None:
    cfg = composed(
        "recipe=transformer_lm_scaling",
        "model.num_layers=2",
        "model.d_model=32",
        "model.ffn_dim=64",
        "model.num_heads=2",
        "data.vocab_size=64",
        "data.seq_len=16",
        "data.batch_size=8",
        "pipeline.chunks=4",
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "logger.progress=none",
    )
    summary = train_in_process(cfg, tmp_path, "# test\n")
    assert summary["train/tokens_per_s"] > 0 and summary["pipeline/balance"] == [2, 2]
    assert summary["eval/loss"] < 10


# -- the quick start on your corpus ----------------------------------------------------------


@pytest.fixture(scope="module")
def your_corpus(tmp_path_factory) -> dict[str, Path]:
    """Two high-resource and two low-resource pairs (en <-> xa, en <-> xb) as JSONL training
    sentences and parquet held-out ones, one held-out line longer than data.max_len."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    files = write_synthetic_corpus(
        root, num_languages=2, train_sizes=[400, 80], eval_size=6, fmt="jsonl"
    )
    rows = [json.loads(line) for line in files["valid"].read_text().splitlines()]
    long = {"source": "the big dog " * 40 + ".", "target": "hanu " * 60 + ".", "pair": "en-xa"}
    rows.append(long)
    pq.write_table(pa.Table.from_pylist(rows), root / "valid.parquet")
    return {"train": files["train"], "valid": root / "valid.parquet"}


@pytest.mark.slow
def test_the_quick_start_trains_on_your_corpus_and_reports_bleu_per_pair(
    your_corpus: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    files = [
        "data=translation",
        f"data.train_files=[{your_corpus['train']}]",
        f"data.valid_files=[{your_corpus['valid']}]",
    ]
    steps = ["trainer.max_steps=2", "trainer.eval_every=2", f"hydra.run.dir={run_dir}"]
    ok(train(*TINY, *files, *steps, cwd=tmp_path))
    summary = json.loads((run_dir / "summary.json").read_text())
    pairs = {k for k in summary if k.startswith("eval/bleu/")}
    assert pairs == {f"eval/bleu/{p}" for p in ("en-xa", "xa-en", "en-xb", "xb-en")}
    log = (run_dir / "train.log").read_text()
    assert f"held-out ({your_corpus['valid']}): 1 of 25 sentence pairs are longer than" in log


@pytest.mark.slow
def test_a_malformed_corpus_line_is_one_line_naming_key_file_and_line(
    your_corpus: dict[str, Path], tmp_path: Path
) -> None:
    train_file = tmp_path / "train.tsv"
    train_file.write_text("source\ttarget\tpair\nthe dog .\thanu .\ten-xa\nthe cat .\ten-xa\n")
    files = [f"data.train_files=[{train_file}]", f"data.valid_files=[{your_corpus['valid']}]"]
    result = train(*TINY, *files, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"error: data.train_files: {train_file}, line 3: 2 tab-separated field(s), expected 3 "
        "as in the header (source, target, pair)"
    ]
