"""The backward split into B (input gradients) and W (weight gradients) equals one backward."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from giantpipe.engine.split_backward import backward_input


class PairBlock(nn.Module):
    """(h, skip) -> (h', h): a pass-through output, as AmoebaNet's cells have."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h, skip = pair
        return torch.relu(self.bn(self.fc(h))) + skip, h


class SharedWeight(nn.Module):
    """One weight used twice, on the input path and off it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 3)
        self.table = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(x @ self.w) @ self.w
        return h * self.table, (self.table * 2).expand(x.shape[0], 6)  # 2nd: params only


def chain() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))


def conv() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)
    )


def embed() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 6), nn.LayerNorm(6), nn.Linear(6, 6))


CASES: list[tuple[str, Callable[[], nn.Module], Callable[[], tuple]]] = [
    ("chain", chain, lambda: (torch.randn(5, 6, requires_grad=True),)),
    ("conv", conv, lambda: (torch.randn(3, 2, 5, 5, requires_grad=True),)),
    (
        "pair",
        PairBlock,
        lambda: ((torch.randn(5, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)),),
    ),
    ("shared", SharedWeight, lambda: (torch.randn(5, 6, requires_grad=True),)),
    ("no-input-grad", chain, lambda: (torch.randn(5, 6),)),
    ("int-input", embed, lambda: (torch.randint(0, 10, (5, 3)),)),
]


def run(module: nn.Module, x: object, split: bool) -> tuple[list, list]:
    inputs = x if isinstance(x, tuple) else (x,)
    y = module(x)
    outs = list(y) if isinstance(y, tuple) else [y]
    torch.manual_seed(3)
    grads = [torch.randn_like(o) for o in outs]
    if split:
        input_grads, weight = backward_input(outs, grads, list(inputs), module.parameters())
        assert all(p.grad is None for p in module.parameters())
        weight.run()
    else:
        torch.autograd.backward(outs, grads)
        input_grads = tuple(t.grad if t.requires_grad else None for t in inputs)
    return list(input_grads), [p.grad for p in module.parameters()]


@pytest.mark.parametrize(("name", "build", "make_input"), CASES, ids=[c[0] for c in CASES])
def test_split_backward_equals_backward(name: str, build: Callable, make_input: Callable) -> None:
    torch.manual_seed(0)
    module = build()
    (x,) = make_input()
    x_ref = (
        tuple(t.detach().requires_grad_(t.requires_grad) for t in x)
        if isinstance(x, tuple)
        else x.detach().requires_grad_(x.requires_grad)
    )
    ref_inputs, ref_params = run(copy.deepcopy(module), x_ref, split=False)
    got_inputs, got_params = run(module, x, split=True)
    for a, b in zip(got_inputs, ref_inputs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    for a, b in zip(got_params, ref_params):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b)


def test_weight_gradient_accumulates_onto_existing_grads() -> None:
    layer = nn.Linear(3, 3)
    x = torch.randn(4, 3, requires_grad=True)
    layer(x).sum().backward()
    first = layer.weight.grad.clone()
    y = layer(x)
    _, weight = backward_input([y.sum()], [None], [x], layer.parameters())
    weight.run()
    torch.testing.assert_close(layer.weight.grad, 2 * first)


def test_b_does_not_recompute_the_input_path_in_w() -> None:
    """W runs each linear's weight side only: count the matmuls autograd performs."""
    model = chain()
    x = torch.randn(5, 6, requires_grad=True)
    y = model(x)
    _, weight = backward_input([y], [torch.ones_like(y)], [x], model.parameters())
    calls: list[str] = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.__name__.startswith("mm"):
                calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Count():
        weight.run()
    assert len(calls) == 3  # one weight-gradient matmul per Linear, no input-gradient matmul
