"""``model._target_=tests.distributed.failing_model.mlp``: the MLP of ``models.mlp`` whose head
kills its process on its ``GIANTPIPE_TEST_DIE_AT``-th forward call (a rank that dies mid-run)."""

import os

import torch
from torch import nn

from models import mlp as plain


class DyingLinear(nn.Linear):
    """nn.Linear (the same parameter names) that ends the process on the N-th forward."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        DyingLinear.calls += 1
        if DyingLinear.calls == int(os.environ.get("GIANTPIPE_TEST_DIE_AT", "0")):
            os._exit(1)  # no cleanup, no message: as an out-of-memory kill looks to its peers
        return super().forward(x)


def mlp(**kwargs) -> nn.Sequential:
    model = plain.mlp(**kwargs)
    head = model[-1]
    dying = DyingLinear(head.in_features, head.out_features)
    dying.load_state_dict(head.state_dict())
    model[-1] = dying
    return model
