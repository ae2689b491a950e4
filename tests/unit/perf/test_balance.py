"""Balance: the exact min-max cut against brute force, and the three cost policies."""

import itertools
import random

import pytest
import torch
from torch import nn

from giantpipe.perf.balance import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    profile_sizes,
    solve_balance,
    stage_costs,
)


def brute_force(costs: list[float], k: int) -> float:
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_solver_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [rng.choice([0.0, 1.0, 2.5, rng.random() * 10]) for _ in range(n)]
    balance = solve_balance(costs, k)
    assert len(balance) == k and sum(balance) == n and min(balance) >= 1
    assert max(stage_costs(costs, balance)) == pytest.approx(brute_force(costs, k))


@pytest.mark.parametrize(
    ("costs", "k", "balance"),
    [
        ([1, 1, 1, 5, 1, 1], 3, [3, 1, 2]),
        ([1, 1, 1, 1], 4, [1, 1, 1, 1]),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [5, 2, 2]),
        ([10, 1, 1, 1, 1], 2, [1, 4]),
    ],
)
def test_solver_exact_table(costs: list[float], k: int, balance: list[int]) -> None:
    assert solve_balance(costs, k) == balance


def test_solver_handles_thousands_of_layers_quickly() -> None:
    costs = [1.0 + (i % 7) for i in range(2000)]
    balance = solve_balance(costs, 64)
    assert sum(balance) == 2000 and len(balance) == 64


def test_solver_errors() -> None:
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        solve_balance([1, 1], 3)
    with pytest.raises(ValueError, match="non-negative"):
        solve_balance([1, -1], 1)


def test_balance_by_params_puts_the_big_layer_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 400), nn.Linear(400, 4))
    assert balance_by_params(2, model) == [3, 1]


def test_balance_by_time_isolates_the_slow_layer() -> None:
    # Four tiny layers and two ~1000x costlier ones: the exact optimum puts all tiny layers and
    # one big layer on stage 0 ([5, 1]) and stays so under heavy timing noise on a busy machine.
    model = nn.Sequential(
        nn.Linear(8, 8),
        nn.Linear(8, 8),
        nn.Linear(8, 8),
        nn.Linear(8, 1024),
        nn.Linear(1024, 1024),
        nn.Linear(1024, 8),
    )
    sample = torch.randn(512, 8)
    balance = balance_by_time(2, model, sample, repeats=5)
    assert sum(balance) == 6 and balance[0] >= 4  # the cheap 8-wide layers share stage 0
    assert all(p.grad is None for p in model.parameters())  # profiling leaves the model alone


def test_balance_by_size_counts_measured_activations() -> None:
    # Same parameters, but layer 1 saves a big activation (the ReLU output of a wide layer).
    model = nn.Sequential(
        nn.Linear(16, 16),
        nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
        nn.Linear(16, 16),
        nn.Linear(16, 16),
    )
    sizes = profile_sizes(model, torch.randn(64, 16), param_scale=2.0, device=torch.device("cpu"))
    params = 2.0 * (16 * 16 + 16) * 4
    # layer 0 saves its input (64x16 floats); layer 1 its input and the ReLU result.
    assert sizes[0] == params + 64 * 16 * 4
    assert sizes[1] == params + 2 * 64 * 16 * 4
    assert balance_by_size(2, model, torch.randn(64, 16)) in ([2, 2], [1, 3])


@pytest.mark.parametrize("policy", ["time", "size"])
def test_profiling_leaves_the_global_generator_where_it_was(policy: str) -> None:
    # The engine draws each step's seed from the global generator: profiling a model with
    # dropout must not move it, or a balanced run would differ from the same balance given.
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5))
    sample = torch.randn(4, 8)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    if policy == "time":
        balance_by_time(2, model, sample, repeats=1)
    else:
        balance_by_size(2, model, sample)
    assert torch.equal(torch.rand(3), expected)
