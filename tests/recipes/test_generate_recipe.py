"""recipes/generate.py on a saved run (config.yaml + a weights file): the continuation of each
prompt through two stages and two micro-batches (prompts of two lengths), equal to cached
generation of the plain model prompt by prompt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from giantpipe.engine.generate import Decoding, generate
from models.transformer import transformer_lm

REPO = Path(__file__).resolve().parents[2]
MODEL = {
    "_target_": "models.transformer_lm.transformer_lm",
    "num_layers": 2,
    "d_model": 16,
    "ffn_dim": 32,
    "num_heads": 2,
    "vocab_size": 30,
    "max_len": 32,
}


def run(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "generate.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={
            "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
            "PATH": "/usr/bin:/bin",
            "OMP_NUM_THREADS": "1",
        },
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


PROMPTS = ["3 4 5", "7 8 9", "1 2"]
"""Two lengths: the recipe puts equal lengths in one micro-batch."""


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
