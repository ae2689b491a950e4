"""fp16 with a gradient scaler through the local pipe equals the plain model with torch's scaler.

Each step compares the loss (unscaled), the scaled gradients, the weights after
``scaler.step`` and the scale after ``scaler.update()``; the steps include a forward that
overflows (huge inputs: the loss itself is inf) and a backward that overflows (a huge scale:
the loss is finite, the fp16 gradients are not), where both must skip the update and halve
the scale.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.fp16 import current_scale, pipeline_grad_scaler, scale_gradient

mse = nn.functional.mse_loss
FP16 = torch.float16


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def batch(step: int, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g) * gain, torch.randn(16, 4, generator=g)


# (input gain, scale set before the step): a plain step, a forward overflow, a plain step, a
# backward overflow (2**30 times gradients of ~0.1 is far beyond fp16's 65504).
STEPS = [(1.0, None), (1e5, None), (1.0, None), (1.0, 2.0**30)]


def assert_grads(plain: nn.Module, pipe: nn.Module, what: str) -> None:
    for (name, a), b in zip(plain.named_parameters(), pipe.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        finite = bool(torch.isfinite(a.grad).all())
        assert bool(torch.isfinite(b.grad).all()) == finite, f"{what} {name}: overflow differs"
        if finite:  # fp16 arithmetic on other row blocks: close, not equal
            scale = float(a.grad.abs().max())
            torch.testing.assert_close(
                b.grad, a.grad, rtol=0, atol=3e-3 * scale, msg=f"{what} {name}"
            )


@pytest.mark.parametrize(("schedule", "recompute"), [("gpipe", "always"), ("zb-h1", "never")])
def test_fp16_scaler_equals_plain_model_with_overflows(schedule: str, recompute: str) -> None:
    plain = mlp()
    pipe = GPipe(
        copy.deepcopy(plain),
        balance=[3, 2],
        devices=["cpu", "cpu"],
        chunks=4,
        schedule=schedule,
        recompute=recompute,
    )
    settings = {"init_scale": 2.0**10, "growth_interval": 1}  # the scale moves every step
    plain_scaler = torch.amp.GradScaler("cpu", **settings)
    scaler = pipeline_grad_scaler(pipe, **settings)
    assert type(scaler) is torch.amp.GradScaler  # every stage in this process: torch's own
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    skipped = []
    for step, (gain, new_scale) in enumerate(STEPS):
        what = f"{schedule} step {step}"
        if new_scale is not None:
            plain_scaler.update(new_scale)
            scaler.update(new_scale)
        x, y = batch(step, gain)
        plain_opt.zero_grad()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            plain_loss = mse(plain(x), y)
            loss = pipe.train_step(x, y, mse, grad_scaler=scaler)
        plain_scaler.scale(plain_loss).backward()
        if torch.isfinite(plain_loss):  # the loss returned is the unscaled one
            torch.testing.assert_close(loss, plain_loss.detach(), rtol=1e-4, atol=0)
        else:
            assert not torch.isfinite(loss), what
        assert_grads(plain, pipe, what)
        before = [p.detach().clone() for p in pipe.parameters()]
        plain_scaler.step(plain_opt)
        scaler.step(opt)
        plain_scaler.update()
        scaler.update()
        assert scaler.get_scale() == plain_scaler.get_scale(), what  # powers of two: exact
        unchanged = all(torch.equal(p, b) for p, b in zip(pipe.parameters(), before, strict=True))
        skipped.append(unchanged)
        for a, b in zip(plain.parameters(), pipe.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4, msg=what)
    assert skipped == [False, True, False, True]  # both overflows skipped, the rest stepped
    assert scaler.get_scale() == 2.0**29


def test_train_step_reads_no_scale_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = GPipe(mlp(), balance=[3, 2], devices=["cpu", "cpu"], chunks=2)
    scaler = pipeline_grad_scaler(pipe, init_scale=4.0)
    unscaled = GPipe(mlp(), balance=[3, 2], devices=["cpu", "cpu"], chunks=2)
    x, y = batch(0)
    unscaled.train_step(x, y, mse)

    def host_read(*_: object) -> float:
        raise AssertionError("the step read the scale back (a host sync on CUDA)")

    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", host_read)
    pipe.train_step(x, y, mse, grad_scaler=scaler)
    for a, b in zip(unscaled.parameters(), pipe.parameters(), strict=True):
        assert torch.equal(b.grad, 4.0 * a.grad)  # a power of two scales exactly (fp32)


def test_a_disabled_scaler_changes_nothing() -> None:
    assert current_scale(torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu")) is None
    loss = torch.tensor(2.0, requires_grad=True)
    assert scale_gradient(loss, None) is loss
