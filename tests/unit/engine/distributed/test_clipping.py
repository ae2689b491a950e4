"""Global-norm clipping of the distributed pipe: torch's result, without a host sync.

On CUDA the norm must stay on the device (all-reduced as a device tensor on the device
pipeline group) and the gradients be scaled by a clamped coefficient tensor, so the host never
waits for the GPU. On CPU the host reads that would sync (``.item()``, ``.cpu()``, ``float()``,
``bool()``, ``.tolist()``) are made to raise while it runs; on a GPU
``torch.cuda.set_sync_debug_mode("error")`` says the same (benchmarks/gpu_check.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from giantpipe.engine.distributed.clipping import clip_grad_norm_

HOST_READS = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextmanager
def host_reads_refused() -> Iterator[None]:
    """Within it, a tensor read back on the host (which would sync with a GPU) raises."""

    def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise AssertionError("a host read of a tensor: on CUDA the host would wait for the GPU")

    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, refuse)
        yield


def _model_with_grads(scale: float) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model(torch.randn(4, 5)).sum().mul(scale).backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("scale", [100.0, 1e-3], ids=["clipped", "under_the_limit"])
def test_clip_equals_torch_without_reading_the_norm_on_the_host(
    norm_type: float, scale: float
) -> None:
    mine = _model_with_grads(scale)
    theirs = _model_with_grads(scale)
    before = [p.grad.clone() for p in mine.parameters()]
    with host_reads_refused():
        norm = clip_grad_norm_(mine.parameters(), 0.5, norm_type=norm_type, device="cpu")
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type=norm_type)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-7)
    for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    if scale < 1.0:  # under the limit: every gradient bit for bit as it was
        assert all(torch.equal(p.grad, b) for p, b in zip(mine.parameters(), before, strict=True))


def test_the_norm_stays_on_the_gradients_device() -> None:
    # "meta" stands for a device the host cannot read: the norm is computed and kept there.
    params = [
        nn.Parameter(torch.ones(3, device="meta")),
        nn.Parameter(torch.ones(2, device="meta")),
    ]
    for p in params:
        p.grad = torch.ones_like(p)
    norm = clip_grad_norm_(params, 0.5)
    assert norm.device.type == "meta"


def test_a_rank_without_gradients_has_a_zero_norm_on_its_device() -> None:
    params = [nn.Parameter(torch.ones(3))]
    with host_reads_refused():
        norm = clip_grad_norm_(params, 1.0, device="cpu")
    assert norm.device.type == "cpu" and torch.equal(norm, torch.zeros(()))
