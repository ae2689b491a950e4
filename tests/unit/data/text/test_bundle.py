"""data=text: a user's text files (globs of .txt / .jsonl / .parquet, a saved datasets folder) as
packed LM batches, a pure function of (seed, position); errors naming the key, the file and the
line; a tiny Llama and Transformer-L beat the unigram baseline; a resume sees the same batches."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    OptimConfig,
    PipelineConfig,
    TrainerConfig,
)
from giantpipe.data.options import TextDataConfig
from giantpipe.data.text.bundle import read_text_corpus, text
from giantpipe.runner import train


def test_batches_are_a_pure_function_of_seed_and_position(corpus: Path, tmp_path: Path) -> None:
    bundle = text([str(corpus / "*.txt")], 16, 4, 200, cache_dir=str(tmp_path))
    stream = bundle.train_batches(7, 0)
    first = [next(stream) for _ in range(bundle.batches_per_epoch + 3)]  # into the 2nd epoch
    for position in (0, 5, bundle.batches_per_epoch + 1):
        x, y = next(bundle.train_batches(7, position))
        assert torch.equal(x, first[position][0]) and torch.equal(y, first[position][1])
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(next(bundle.train_batches(8, 0))[0], first[0][0])


@pytest.mark.parametrize(
    ("files", "content", "expected"),
    [
        (["nothing/*.txt"], None, "data.files: 'nothing/*.txt' matches no file"),
        ([], None, "data.files: no files given"),
        (["d.jsonl"], '{"text": "ok"}\n{"text": "ok"\n', "d.jsonl, line 2: not JSON"),
        (["d.jsonl"], '{"text": "ok"}\n\n{"body": "x"}\n', "d.jsonl, line 3: no field ['text']"),
        (["d.jsonl"], '{"text": "ok"}\n{"text": 3}\n', "d.jsonl, line 2: field 'text' is 3"),
        (["d.txt"], b"fine\n\xff\xfe\n", "d.txt, line 2: not UTF-8 text"),
        (["d.csv"], "a,b\n", "d.csv: unknown format '.csv'"),
        (["d.txt"], "only one document\n", "data.files: 1 document(s); a held-out split needs"),
    ],
)
def test_errors_name_the_key_the_file_and_the_line(files, content, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        path = Path(files[0])
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as err:
        text(files, seq_len=4, batch_size=1, vocab_size=50)
    assert expected in str(err.value)
    assert str(err.value).startswith("data.")


def test_too_little_text_for_a_batch_names_the_keys(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.batch_size: is 4096, but the training documents"):
        text([str(corpus / "*.txt")], 16, 4096, 200, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="data.valid_fraction: the held-out documents hold fewer"):
        text([str(corpus / "*.txt")], 4000, 1, 200, cache_dir=str(tmp_path))


def unigram_baseline(rows_train: torch.Tensor, rows_valid: torch.Tensor, vocab: int) -> float:
    """The test's own baseline: add-one unigram frequencies of the training targets, scored on
    the held-out targets."""
    counts = torch.bincount(rows_train[:, 1:].flatten(), minlength=vocab).double() + 1
    probs = counts / counts.sum()
    return math.exp(-probs[rows_valid[:, 1:].flatten()].log().mean().item())


def lm_config(model, corpus: Path, cache: Path, steps: int) -> ExperimentConfig:
    return ExperimentConfig(
        name="text",
        model=model,
        data=TextDataConfig(
            files=[str(corpus / "*.txt")],
            seq_len=32,
            batch_size=8,
            vocab_size=128,
            cache_dir=str(cache),
            valid_fraction=0.1,
        ),  # fmt: skip
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        optim=OptimConfig(lr=3e-3),
        trainer=TrainerConfig(max_steps=steps, eval_every=0, log_every=10, checkpoint_every=0),
        logger=LoggerConfig(progress="none"),
    )


def beats_unigram(cfg: ExperimentConfig, corpus: Path, run_dir: Path) -> tuple[float, float]:
    summary = train(cfg, run_dir, "name: text\n")
    rows = read_text_corpus([str(corpus / "*.txt")], 32, 128, cache_dir=cfg.data.cache_dir)
    baseline = unigram_baseline(rows.train_rows, rows.valid_rows, 128)
    recorded = json.loads((run_dir / "text_data.json").read_text())["unigram_perplexity"]
    assert recorded == pytest.approx(baseline)
    return math.exp(summary["eval/loss"]), baseline


def test_a_tiny_llama_on_text_beats_the_unigram_baseline(corpus: Path, tmp_path: Path) -> None:
    pytest.importorskip("models.hf")
    from models.options import HfCausalLmModelConfig

    model = HfCausalLmModelConfig(layers=2, width=32, heads=2, vocab_size=128, max_len=32)
    perplexity, baseline = beats_unigram(lm_config(model, corpus, tmp_path, 40), corpus, tmp_path)
    assert perplexity < 0.5 * baseline, (perplexity, baseline)


def test_transformer_lm_on_text_beats_the_unigram_baseline(corpus: Path, tmp_path: Path) -> None:
    from models.options import TransformerLMModelConfig

    model = TransformerLMModelConfig(
        num_layers=2, d_model=32, ffn_dim=64, num_heads=2, vocab_size=128, max_len=32
    )
    perplexity, baseline = beats_unigram(lm_config(model, corpus, tmp_path, 40), corpus, tmp_path)
    assert perplexity < 0.5 * baseline, (perplexity, baseline)


def test_a_resumed_run_sees_the_same_batches_even_without_the_cache(corpus, tmp_path) -> None:
    from models.options import TransformerLMModelConfig

    model = TransformerLMModelConfig(
        num_layers=2, d_model=16, ffn_dim=32, num_heads=2, vocab_size=128, max_len=32
    )
    cfg = lm_config(model, corpus, tmp_path / "cache", 4)
    cfg.trainer.log_every, cfg.trainer.checkpoint_every = 1, 2

    def losses(run_dir: Path) -> dict[int, float]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}

    train(cfg, tmp_path / "full", "")
    cfg.trainer.max_steps = 2
    train(cfg, tmp_path / "part", "")
    shutil.rmtree(tmp_path / "cache")  # the run's own copy of the tokenizer is used
    cfg.trainer.max_steps, cfg.trainer.resume = 4, True
    train(cfg, tmp_path / "part", "")
    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    assert not (tmp_path / "cache").exists()
