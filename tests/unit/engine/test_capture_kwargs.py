"""Captured ops keep their keyword arguments: a piece replays each op with the arguments the
model gave it, keyword-only ones included. Every test model elsewhere uses the defaults (SDPA's
``scale`` among them), so an op replayed without its keywords would go unnoticed there: GPT-2
with ``scale_attn_by_inverse_layer_idx`` would be off by about 3e-4. Here every op is called
with a value that is not its default, and the pipelined model must equal the original."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from giantpipe import GPipe, sequentialize
from giantpipe.testing import reference_step
from tests.unit.engine.token_batches import VOCAB, assert_same_grads, token_loss, tokens

D, HEADS, BATCH, T = 16, 2, 8, 6


class Attention(nn.Module):
    """SDPA with a non-default ``scale`` (keyword-only in aten), causal, optional dropout."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.dropout = dropout

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).unflatten(-1, (3, HEADS, D // HEADS)).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=0.05)
        return a.transpose(1, 2).flatten(2)


class Block(nn.Module):
    """Ops whose behaviour is set by a keyword, each away from its default."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attn = Attention(dropout)
        self.fc = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = F.gelu(self.attn(h), approximate="tanh")
        a = F.layer_norm(a, (D,), eps=0.5)
        a = F.leaky_relu(self.fc(a), negative_slope=0.3)
        a = a + torch.softmax(a, dim=1) + torch.cumsum(a, dim=-1, dtype=torch.float64).float()
        a = a + torch.div(a.detach() * 4, 3, rounding_mode="floor")
        a = a + F.dropout(a, p=0.4, training=False)  # p, training: keywords of a dropout in eval
        a = a + a.mean(-1, keepdim=True)
        wide = F.interpolate(a.transpose(1, 2), scale_factor=2.0, mode="linear")
        return h + wide.transpose(1, 2)[:, ::2]


class KeywordModel(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(dropout) for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def ids_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    ids, _, labels = tokens()
    return ids[:, :T], labels[:, :T]


def pipelined_step(seq: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> GPipe:
    pipe = GPipe(copy.deepcopy(seq), [2, 2], devices=["cpu"] * 2, chunks=2)
    pipe.train_step(ids, labels, token_loss)
    return pipe


def test_ops_called_with_keywords_pipelined_equal_the_original() -> None:
    model = KeywordModel()
    ids, labels = ids_and_labels()
    seq = sequentialize(model, ids)
    assert len(seq) == 4  # embed, 2 blocks, head
    torch.testing.assert_close(seq(ids), model(ids), rtol=0, atol=0)
    plain, _ = reference_step(model, ids, labels, 2, 0, token_loss)  # no dropout: any seed
    assert_same_grads(pipelined_step(seq, ids, labels), plain)


def test_attention_dropout_layer_keeps_the_scale_in_eval() -> None:
    # With dropout in training, SDPA becomes a RandomOp layer (its mask is seeded by the
    # engine); in eval it runs without dropout and must still use scale=0.05.
    model = KeywordModel(dropout=0.2)
    ids, _ = ids_and_labels()
    seq = sequentialize(model, ids)
    pipe = GPipe(copy.deepcopy(seq), [2, 2], devices=["cpu"] * 2, chunks=2).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(ids), model(ids), rtol=0, atol=0)


def test_gpt2_scaled_by_inverse_layer_index_pipelined_equals_the_original() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        scale_attn_by_inverse_layer_idx=True,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids, _, labels = tokens()
    seq = sequentialize(model, input_ids=ids, output="logits")
    torch.testing.assert_close(seq(ids), model(input_ids=ids).logits, rtol=0, atol=0)
    pipe = pipelined_step(seq, ids, labels)
    plain = copy.deepcopy(model)
    for x, y in zip(ids.chunk(2), labels.chunk(2)):
        (token_loss(plain(input_ids=x).logits, y) / 2).backward()
    assert_same_grads(pipe, plain)
