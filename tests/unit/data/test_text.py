"""data=text: a user's text files (globs of .txt / .jsonl / .parquet, a saved datasets folder) as
packed LM batches; documents held out by seed; the tokenizer trained once and cached by content;
errors naming the file and the line; a tiny Llama and Transformer-L beat the unigram baseline."""

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
from giantpipe.data.text import TextDataConfig, read_documents, read_text_corpus, text
from giantpipe.runner import train
from tests.recipes.scripts import load_script

torch.set_num_threads(1)
write_corpus = load_script("recipes/text_lm.py").write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The generated grammar corpus: 4 .txt files, 300 paragraphs."""
    return write_corpus(tmp_path_factory.mktemp("text") / "corpus", documents=300, seed=0)


def test_every_format_is_read_one_document_per_paragraph_line_or_row(tmp_path: Path) -> None:
    import datasets

    (tmp_path / "a.txt").write_text("first para\nstill first\n\n\nsecond para\n")
    (tmp_path / "b.jsonl").write_text('{"body": "a json doc"}\n\n{"body": "another"}\n')
    datasets.Dataset.from_dict({"body": ["parquet row"]}).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_dict({"body": ["saved 1", "saved 2"]}).save_to_disk(str(tmp_path / "ds"))
    corpus = read_text_corpus(
        [str(tmp_path / "*.*"), str(tmp_path / "ds")],
        seq_len=4,
        vocab_size=40,
        text_field="body",
        valid_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    assert (corpus.documents, corpus.held_out) == (7, 1)
    docs = [d.text for d in read_documents([tmp_path / "a.txt"], "text", "paragraph")]
    assert docs == ["first para\nstill first", "second para"]
    wheres = [d.where for d in read_documents([tmp_path / "a.txt"], "text", "line")]
    assert wheres == [f"{tmp_path / 'a.txt'}, line {n}" for n in (1, 2, 5)]


def test_documents_are_held_out_whole_and_by_seed(corpus: Path, tmp_path: Path) -> None:
    def split(seed: int) -> tuple[set[str], set[str]]:
        c = read_text_corpus([str(corpus / "*.txt")], 16, 200, seed=seed, cache_dir=str(tmp_path))
        decode = c.vocab.decode
        eos = c.vocab.eos_id

        def docs(rows: torch.Tensor) -> set[str]:
            ids = torch.cat([rows[:1, 0], rows[:, 1:].flatten()]).tolist()  # overlap by one
            pieces, current = [], []
            for token in ids:
                if token == eos:
                    pieces.append(decode(current))
                    current = []
                else:
                    current.append(token)
            return set(pieces[1:])  # the first may start mid-document only in theory: drop it

        return docs(c.train_rows), docs(c.valid_rows)

    train_docs, held_docs = split(seed=1)
    assert held_docs and not train_docs & held_docs  # no held-out document is trained on
    assert split(seed=1)[1] == held_docs
    assert split(seed=2)[1] != held_docs


def test_batches_are_a_pure_function_of_seed_and_position(corpus: Path, tmp_path: Path) -> None:
    bundle = text([str(corpus / "*.txt")], 16, 4, 200, cache_dir=str(tmp_path))
    stream = bundle.train_batches(7, 0)
    first = [next(stream) for _ in range(bundle.batches_per_epoch + 3)]  # into the 2nd epoch
    for position in (0, 5, bundle.batches_per_epoch + 1):
        x, y = next(bundle.train_batches(7, position))
        assert torch.equal(x, first[position][0]) and torch.equal(y, first[position][1])
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(next(bundle.train_batches(8, 0))[0], first[0][0])


def test_the_tokenizer_is_trained_once_and_keyed_by_the_files_content(tmp_path: Path) -> None:
    data = write_corpus(tmp_path / "c", documents=40)
    cache = data / ".giantpipe_cache"
    read_text_corpus([str(data / "*.txt")], 8, 100)  # cached beside the data by default
    (model,) = cache.glob("*.model")
    stamp = model.stat().st_mtime_ns
    read_text_corpus([str(data / "*.txt")], 8, 100)
    assert [p.stat().st_mtime_ns for p in cache.glob("*.model")] == [stamp]  # reused
    with (data / "part_00.txt").open("a") as f:
        f.write("\nA new paragraph about the river.\n")
    read_text_corpus([str(data / "*.txt")], 8, 100)
    assert len(list(cache.glob("*.model"))) == 2  # other content, another tokenizer


def test_a_hugging_face_tokenizer_directory(corpus: Path, tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = sorted({w for p in corpus.glob("*.txt") for w in p.read_text().split()})
    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>"
    )
    fast.save_pretrained(str(tmp_path / "tok"))
    c = read_text_corpus([str(corpus / "*.txt")], 8, len(vocab), tokenizer=str(tmp_path / "tok"))
    assert c.vocab.size == len(vocab) and c.vocab.eos_id == 1
    assert c.vocab.decode(c.train_rows[0, :3].tolist()).split()[0] in words
    with pytest.raises(ConfigError, match=rf"data.vocab_size: is 10, but .* has {len(vocab)} ids"):
        read_text_corpus([str(corpus / "*.txt")], 8, 10, tokenizer=str(tmp_path / "tok"))


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


def test_the_schema_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="data.valid_fraction"):
        TextDataConfig(files=["a.txt"], valid_fraction=1.0)
    with pytest.raises(ValueError, match="data.txt_documents"):
        TextDataConfig(files=["a.txt"], txt_documents="chapter")


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
