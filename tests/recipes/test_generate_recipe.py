"""recipes/generate.py on a saved run (config.yaml + a weights file): the continuation of each
prompt through two stages and two micro-batches (prompts of two lengths, sharing a
micro-batch), equal to cached generation of the plain model prompt by prompt; a trained
``data=text`` run decoded in words (``--text``); every kind of bad input one line, exit 2."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from giantpipe.engine.generate import Decoding, generate
from models.transformer import transformer_lm
from tests.support.train import REPO, train

MODEL = {
    "_target_": "models.transformer_lm.transformer_lm",
    "num_layers": 2,
    "d_model": 16,
    "ffn_dim": 32,
    "num_heads": 2,
    "vocab_size": 30,
    "max_len": 32,
}


ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def launch(*args: str) -> subprocess.CompletedProcess:
    """``python recipes/generate.py ARGS``."""
    script = REPO / "recipes" / "generate.py"
    return train(*args, cwd=REPO, script=script, env=ONE_THREAD, timeout=240)


def run(*args: str) -> list[str]:
    done = launch(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


PROMPTS = ["3 4 5", "7 8 9", "1 2"]
"""Two lengths: "7 8 9" and "1 2" share the second micro-batch (left-padded, masked)."""


def continue_prompts(weights: Path) -> list[str]:
    """The recipe's lines for :data:`PROMPTS`, 6 new tokens each, through 2 stages and 2
    micro-batches."""
    prompts = [f"--prompt={p}" for p in PROMPTS]
    return run(str(weights), *prompts, "--max-new=6", "--stages=2", "--chunks=2")


@pytest.mark.slow
def test_a_language_model_run_continues_its_prompts_through_two_stages(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformer_lm(**{k: v for k, v in MODEL.items() if k != "_target_"})
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": MODEL}))
    lines = continue_prompts(tmp_path / "model.pt")
    plain = model.eval()
    expected = [
        generate(plain, [torch.tensor([[int(t) for t in p.split()]])], [6], Decoding())[0][0]
        for p in PROMPTS
    ]
    assert lines == [
        f"{p} -> {' '.join(map(str, t))}" for p, t in zip(PROMPTS, expected, strict=True)
    ]


@pytest.mark.slow
def test_a_translation_run_translates_as_the_reference_beam_search(tmp_path: Path) -> None:
    from giantpipe.data.translation.decoding import beam_search
    from giantpipe.data.translation.files import load_parallel_corpus
    from giantpipe.data.translation.generated import write_synthetic_corpus
    from giantpipe.data.translation.vocabulary import SharedVocabulary
    from models.transformer import transformer_t

    files = write_synthetic_corpus(tmp_path / "data", num_languages=2, train_sizes=[300, 60])
    vocab = SharedVocabulary.train_or_load(
        load_parallel_corpus([files["train"]]), tmp_path, vocab_size=200
    )
    sizes = {"num_layers": 1, "ffn_dim": 32, "num_heads": 2, "d_model": 16, "head_dim": 8}
    sizes |= {"vocab_size": vocab.vocab_size, "max_len": 64}
    torch.manual_seed(0)
    model = transformer_t(**sizes).eval()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    config = {"model": {"_target_": "models.transformer.transformer_t", **sizes}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    sentence = "the dog sees Anna ."
    lines = run(
        str(tmp_path / "model.pt"), f"--prompt={sentence}", "--to=xa", "--beam=2", "--stages=2"
    )
    src = torch.tensor([[vocab.lang_id("xa"), *vocab.encode(sentence), vocab.eos_id]])
    expected = vocab.decode(beam_search(model, src, beam_size=2)[0])
    assert lines == [f"{sentence} -> {expected}"]


@pytest.mark.slow
def test_a_hugging_face_run_is_captured_and_continues_as_the_uncached_model(
    tmp_path: Path,
) -> None:
    """model=hf_causal_lm: the recipe captures the saved Llama as the runner did, gives its
    pieces their caches and decodes through two stages; the tokens are the plain model's own
    arg-max, re-run on the whole prefix at every step."""
    from models.hf import hf_causal_lm

    sizes = {"architecture": "llama", "layers": 2, "width": 32, "heads": 2, "vocab_size": 30}
    sizes |= {"max_len": 32, "config": {"initializer_range": 0.3}}  # positions move the arg-max
    model = hf_causal_lm(**sizes).eval()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    config = {
        "model": {"_target_": "models.hf.hf_causal_lm", **sizes},
        "pipeline": {"split_points": None, "output": None},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    lines = continue_prompts(tmp_path / "model.pt")
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([[int(t) for t in prompt.split()]])
            for _ in range(6):
                logits = model(input_ids=ids, use_cache=False).logits
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            expected.append(" ".join(map(str, ids[0, len(prompt.split()) :].tolist())))
    assert lines == [f"{p} -> {e}" for p, e in zip(PROMPTS, expected, strict=True)]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small ``data=text`` run trained two steps by train.py (a tokenizer trained on a
    generated corpus, kept in the run directory; a 2-layer transformer_lm), saved in last/."""
    work = tmp_path_factory.mktemp("text_run")
    corpus = train("--generate", "corpus", cwd=work, script=REPO / "recipes" / "text_lm.py")
    assert corpus.returncode == 0, corpus.stderr[-2000:]
    overrides = [
        "model=transformer_lm", "data=text", "data.files=[corpus/*.txt]", "data.seq_len=32",
        "data.batch_size=8", "data.vocab_size=200", "model.num_layers=2", "model.d_model=32",
        "model.ffn_dim=64", "model.num_heads=2", "model.max_len=64", "trainer.max_steps=2",
        "trainer.eval_every=0", "trainer.predict=false", "logger.progress=none",
        "pipeline.chunks=2", "hydra.run.dir=run",
    ]  # fmt: skip
    done = train(*overrides, cwd=work, env=ONE_THREAD, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (work / "run" / "last" / "manifest.json").is_file()
    return work / "run"


@pytest.mark.slow
def test_a_text_run_continues_words_as_its_tokenizer_and_model_do_by_hand(text_run: Path) -> None:
    """``--text``: encoded by the run's own tokenizer, continued through two stages (three
    prompts of unequal length in two micro-batches) up to the end of text, decoded to words;
    equal to doing each step by hand with the run's tokenizer and the plain model."""
    from giantpipe.data.text.vocabulary import Vocabulary
    from giantpipe.runner.run_state.init_from import read_weights

    texts = ["the old farmer", "a fox", "the brave sailor watches"]
    args = [f"--text={t}" for t in texts]
    lines = run(str(text_run / "last"), *args, "--max-new=10", "--stages=2", "--chunks=2")
    vocab = Vocabulary.load(next(text_run.glob("spm-*.model")))
    config = yaml.safe_load((text_run / "config.yaml").read_text())["model"]
    model = transformer_lm(**{k: v for k, v in config.items() if k != "_target_"})
    model.load_state_dict(read_weights(text_run / "last"))
    decoding = Decoding(eos_id=vocab.eos_id)
    expected = []
    for text in texts:
        ids = torch.tensor([vocab.encode(text)])
        out = generate(model.eval(), [ids], [10], decoding)[0][0]
        expected.append(f"{text} -> {vocab.decode(out).strip()}")
    assert lines == expected
    assert len({len(vocab.encode(t)) for t in texts[1:]}) == 2  # one micro-batch, two lengths


@pytest.mark.slow
def test_the_run_directory_generates_as_its_last_checkpoint(text_run: Path) -> None:
    """``generate.py RUN``, the natural thing to type, is ``generate.py RUN/last``."""
    args = ["--text=the old farmer", "--max-new=4"]
    assert run(str(text_run), *args) == run(str(text_run / "last"), *args)


def damaged(run: Path, tmp: Path) -> Path:
    copy = tmp / "run"
    shutil.copytree(run, copy)
    (copy / "last" / "manifest.json").write_text("{garbage")
    return copy / "last"


def image_run(run: Path, tmp: Path) -> Path:
    from models.amoebanet import amoebanetd

    sizes = {"num_layers": 3, "num_filters": 16, "num_classes": 10}
    torch.save(amoebanetd(**sizes).state_dict(), tmp / "model.pt")
    config = {"model": {"_target_": "models.amoebanet.amoebanetd", **sizes}}
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp / "model.pt"


def token_run(run: Path, tmp: Path) -> Path:
    """The same weights, its config saying token data (no tokenizer kept)."""
    shutil.copytree(run / "last", tmp / "last")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"] = {"_target_": "giantpipe.data.lm_tokens.lm_tokens", "vocab_size": 200}
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp / "last"


def no_last(run: Path, tmp: Path) -> Path:
    """The run's directory, its last/ kept only as step_2/."""
    copy = tmp / "run"
    shutil.copytree(run, copy)
    (copy / "last").rename(copy / "step_2")
    return copy


def last(run: Path, tmp: Path) -> Path:
    return run / "last"


BAD: dict[str, tuple[Any, list[str], str]] = {
    "damaged manifest": (damaged, ["--prompt=5 6"], r"last: .*manifest.json is damaged"),
    "image model": (image_run, ["--prompt=5 6"], r"amoebanetd\) cannot generate: .* lacks it"),
    "empty prompt": (last, ["--prompt="], r"--prompt '' is empty"),
    "not ids": (last, ["--prompt=the dog"], r"'the dog' is not token ids.*--text"),
    "beyond the vocabulary": (last, ["--prompt=5 200"], r"token 200 is outside .* \(0..199\)"),
    "max-new 0": (last, ["--prompt=5", "--max-new=0"], r"--max-new must be >= 1, got 0"),
    "max-new -3": (last, ["--prompt=5", "--max-new=-3"], r"--max-new must be >= 1, got -3"),
    "no prompt": (last, [], r"give --prompt .* or --text"),
    "text without tokenizer": (token_run, ["--text=a fox"], r"--text: .* kept no tokenizer"),
    "no checkpoint": (lambda run, tmp: tmp / "last", ["--prompt=5"], r"no such run or checkpoint"),
    "run without last/": (no_last, ["--prompt=5"], r"run: the run has no last/ .* e\.g\. .*step_2"),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_naming_it_and_exit_2(
    case: str, text_run: Path, tmp_path: Path
) -> None:
    import re

    where, args, message = BAD[case]
    done = launch(str(where(text_run, tmp_path)), *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert re.search(message, lines[0]), lines[0]
    assert done.stdout == ""
