"""sequentialize works out of the box on the models people bring: Hugging Face GPT-2 and Llama
(built from their config classes, random weights, nothing downloaded) and torchvision ResNet-50
and ViT-B/16. Each is pipelined and compared with the original module: loss and every gradient
by the model's own parameter names, under every schedule and every re-materialization mode
(each at least once per model: capture is what costs here; the full product of both runs on the
small model of test_capture.py), K up to 4; checkpoints load into the original strictly; dropout
masks are replayed. Two layers of width 32: the pieces are embeddings, layer, layer, head.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from giantpipe import GPipe, sequentialize
from giantpipe.perf.balance import solve_balance
from giantpipe.testing import reference_step, step_seed
from tests.unit.engine.token_batches import BATCH, VOCAB, assert_same_grads, token_loss, tokens

MODES = ["always", "except_last", "never"]
# (schedule, K, V, M, recompute): every schedule and every mode, K = 2, 3, 4
CASES = [
    ("gpipe", 2, 1, 4, "always"),
    ("1f1b", 4, 1, 4, "except_last"),
    ("zb-h1", 3, 1, 3, "never"),
    ("interleaved", 2, 2, 4, "always"),
    ("gpipe", 4, 1, 8, "never"),
]


def gpt2(dropout: float = 0.0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)  # input and output embeddings tied


def llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def language_model(request: Any) -> tuple[nn.Module, nn.Sequential]:
    model = {"gpt2": gpt2, "llama": llama}[request.param]()
    ids, mask, _ = tokens()
    seq = sequentialize(model, input_ids=ids, attention_mask=mask, output="logits")
    return model, seq


@pytest.mark.slow
def test_language_model_forward_equals_the_original(language_model) -> None:
    model, seq = language_model
    ids, mask, labels = tokens()
    assert len(seq) == 4  # embeddings, 2 layers, head
    out = seq.unflatten(seq(seq.flatten(input_ids=ids, attention_mask=mask)))
    torch.testing.assert_close(out, model(input_ids=ids, attention_mask=mask).logits)
    model.load_state_dict(seq.state_dict(), strict=True)
    seq.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize(("schedule", "k", "v", "chunks", "mode"), CASES)
def test_language_model_pipelined_equals_the_original(
    language_model, schedule: str, k: int, v: int, chunks: int, mode: str
) -> None:
    model, seq = language_model
    ids, mask, labels = tokens()
    plain = copy.deepcopy(model)
    for x, m, y in zip(ids.chunk(chunks), mask.chunk(chunks), labels.chunk(chunks)):
        logits = plain(input_ids=x, attention_mask=m).logits
        (token_loss(logits, y) * (len(y) / BATCH)).backward()
    pipe = GPipe(
        copy.deepcopy(seq),
        solve_balance([1.0] * len(seq), k * v),
        devices=["cpu"] * k,
        chunks=chunks,
        recompute=mode,
        schedule=schedule,
        virtual_stages=v,
    )
    pipe.train_step(seq.flatten(input_ids=ids, attention_mask=mask), labels, token_loss)
    assert_same_grads(pipe, plain)
    plain.load_state_dict(pipe.state_dict(), strict=True)


@pytest.fixture(scope="module")
def gpt2_with_dropout() -> nn.Sequential:
    ids, _, _ = tokens()
    return sequentialize(gpt2(dropout=0.1), ids, output="logits")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_gpt2_dropout_masks_are_replayed(gpt2_with_dropout, mode: str) -> None:
    ids, mask, labels = tokens()
    seq = gpt2_with_dropout
    plain, ref_loss = reference_step(seq, ids, labels, 4, step_seed(7), token_loss)
    pipe = GPipe(copy.deepcopy(seq), [2, 2], devices=["cpu"] * 2, chunks=4, recompute=mode)
    torch.manual_seed(7)
    loss = pipe.train_step(ids, labels, token_loss)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def vision_case(name: str) -> tuple[nn.Module, torch.Tensor]:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    if name == "resnet50":
        return torchvision.models.resnet50(num_classes=10), torch.randn(4, 3, 32, 32)
    # ViT-B/16 whole (12 layers of width 768); a 16-pixel image is one patch (and the class token)
    return torchvision.models.vit_b_16(num_classes=10, image_size=16), torch.randn(4, 3, 16, 16)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "vit_b_16"])
def test_torchvision_model_pipelined_equals_the_original(name: str) -> None:
    model, x = vision_case(name)
    y = torch.arange(4) % 10
    seq = sequentialize(model, x)
    assert len(seq) == {"resnet50": 18, "vit_b_16": 14}[name]  # stem, blocks, head
    plain = copy.deepcopy(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker: convolutions then add up in the same order
    try:
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (F.cross_entropy(plain(xm), ym) / 2).backward()
    finally:
        torch.set_num_threads(threads)
    halves = [len(seq) // 2, len(seq) - len(seq) // 2]
    pipe = GPipe(copy.deepcopy(seq), halves, chunks=2, threads_per_worker=1)
    pipe.train_step(x, y, F.cross_entropy)
    assert_same_grads(pipe, plain)
    for key, buf in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], buf, msg=key)
    pipe.eval()
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-4, atol=1e-4)
