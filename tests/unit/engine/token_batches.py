"""A batch of token ids for the captured language models' tests, its loss, and the check that a
pipe's gradients are the plain model's."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, BATCH, T = 97, 8, 12


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, T), generator=g)
    mask = torch.ones(BATCH, T, dtype=torch.long)
    mask[::3, -4:] = 0  # right padding on some rows: the attention mask matters
    return ids, mask, torch.randint(0, VOCAB, (BATCH, T), generator=g)


def assert_same_grads(pipe: nn.Module, plain: nn.Module, rtol: float = 1e-4) -> None:
    mine = dict(pipe.state_dict(keep_vars=True))
    for name, p in plain.named_parameters():
        assert mine[name].grad is not None, name
        torch.testing.assert_close(mine[name].grad, p.grad, rtol=rtol, atol=1e-5, msg=name)
