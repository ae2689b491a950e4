"""What each rank runs in tests/distributed/test_capture.py: a Hugging Face GPT-2 (tied
embeddings, attention mask, dropout) sequentialized on every rank and trained by
DistributedPipe, compared with the sequentialized model run micro-batch by micro-batch under the
engine's seeding, by the original model's parameter names."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from giantpipe import sequentialize
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.perf.balance import solve_balance
from giantpipe.testing import step_seed
from tests.distributed.workers import SEED, virtual_stages_for
from tests.support.shards import reference
from tests.timeouts import scaled

VOCAB, BATCH, T = 97, 8, 12


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def gpt2(dropout: float) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, T), generator=g)
    mask = torch.ones(BATCH, T, dtype=torch.long)
    mask[::3, -4:] = 0
    return ids, mask, torch.randint(0, VOCAB, (BATCH, T), generator=g)


def gpt2_equals_the_sequentialized(
    tmp: Path, workers: int, cases: list[tuple[str, int, str]]
) -> dict[str, Any]:
    """Per (schedule, M, mode): this rank's loss and gradients are the reference's, by the
    original model's names."""
    model = gpt2(dropout=0.1)
    ids, mask, labels = tokens()
    seq = sequentialize(model, input_ids=ids, attention_mask=mask, output="logits")
    original = set(model.state_dict())
    checked = []
    for schedule, chunks, mode in cases:
        plain, ref_loss = reference(
            seq, [((ids, mask), labels)], chunks, step_seed(SEED), token_loss
        )
        want = dict(plain.state_dict(keep_vars=True))
        v = virtual_stages_for(schedule, workers, chunks) or 1
        balance = solve_balance([1.0] * len(seq), workers * v)
        pipe = DistributedPipe(
            copy.deepcopy(seq), balance, chunks=chunks, recompute=mode, schedule=schedule,
            virtual_stages=v, init=None, timeout=scaled(60),
        )  # fmt: skip
        torch.manual_seed(SEED)
        x = (ids, mask) if pipe.needs_inputs else None
        loss = pipe.train_step(x, labels if pipe.needs_targets else None, token_loss)
        assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (schedule, mode, loss)
        names = dict(pipe.state_dict(keep_vars=True))
        assert set(names) <= original, "names are the original model's"
        compared = 0
        for name, p in names.items():
            if isinstance(p, nn.Parameter):
                torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-4, atol=1e-5)
                compared += 1
        # The tied embedding is held by the first and the last rank: counted once in the norm
        norm = pipe.clip_grad_norm_(1e9)
        torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
        checked.append((f"{schedule} M={chunks} {mode}", compared))
    return {"checked": checked}
