"""The torchgpipe-compatible front door: attributes, Sequential-like access, the same errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from giantpipe import GPipe


def mlp(n: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


# (kwargs, exception type, message) -- messages as torchgpipe words them, so users switching
# by changing the import see the same errors.
ERRORS = [
    (dict(balance=None), ValueError, "balance is required"),
    (
        dict(balance=[2, 1]),
        ValueError,
        "module and sum of balance have different length (module: 4, sum of balance: 3)",
    ),
    (
        dict(balance=[4, 0]),
        ValueError,
        "all balance numbers must be positive integer (balance: [4, 0])",
    ),
    (dict(balance=[3, -1, 2]), ValueError, "all balance numbers must be positive integer"),
    (dict(balance=[2, 2], chunks=0), ValueError, "number of chunks must be positive integer"),
    (
        dict(balance=[2, 2], checkpoint="sometimes"),
        ValueError,
        "checkpoint is not one of 'always', 'except_last', or 'never'",
    ),
    (
        dict(balance=[1, 1, 1, 1], devices=["cpu", "cpu"]),
        IndexError,
        "too few devices to hold given partitions (devices: 2, partitions: 4)",
    ),
    (dict(balance=[2, 2], schedule="zigzag"), ValueError, "unknown schedule 'zigzag'"),
]


@pytest.mark.parametrize(("kwargs", "exc", "message"), ERRORS)
def test_validation_errors(kwargs: dict, exc: type, message: str) -> None:
    kwargs = {"devices": ["cpu", "cpu"], **kwargs}
    balance = kwargs.pop("balance")
    with pytest.raises(exc) as info:
        GPipe(mlp(), balance, **kwargs)
    assert message in str(info.value)


def test_more_stages_than_layers_is_rejected() -> None:
    with pytest.raises(ValueError, match="sum of balance"):
        GPipe(mlp(2), [1, 1, 1], devices=["cpu"] * 3)


def test_non_sequential_and_shared_layers_are_rejected() -> None:
    with pytest.raises(TypeError, match="must be nn.Sequential"):
        GPipe(nn.Linear(2, 2), [1], devices=["cpu"])  # type: ignore[arg-type]
    shared = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="duplicate children"):
        GPipe(nn.Sequential(shared, shared), [1, 1], devices=["cpu", "cpu"])


@pytest.mark.parametrize(("kwargs", "exc", "message"), ERRORS[1:7])
def test_errors_match_torchgpipe(kwargs: dict, exc: type, message: str) -> None:
    torchgpipe = pytest.importorskip("torchgpipe")
    kwargs = {"devices": ["cpu", "cpu"], **kwargs}
    balance = kwargs.pop("balance")
    with pytest.raises(exc) as theirs:
        torchgpipe.GPipe(mlp(), balance, **kwargs)
    with pytest.raises(exc) as ours:
        GPipe(mlp(), balance, **kwargs)
    assert str(theirs.value).split(" (")[0].split("\n")[0] in str(ours.value)


def test_attributes_and_sequential_access() -> None:
    model = mlp()
    layers = list(model)
    pipe = GPipe(model, [1, 3], devices=["cpu", "cpu"], chunks=2, checkpoint="never")
    assert pipe.balance == [1, 3] and pipe.chunks == 2 and pipe.checkpoint == "never"
    assert pipe.devices == [torch.device("cpu")] * 2
    assert [len(p) for p in pipe.partitions] == [1, 3]
    assert len(pipe) == 4 and pipe[0] is layers[0] and pipe[-1] is layers[-1]
    assert list(pipe) == layers


def test_state_dict_uses_unpartitioned_names_and_moves_between_cuts() -> None:
    model = mlp()
    plain_keys = list(model.state_dict())
    a = GPipe(copy.deepcopy(model), [1, 3], devices=["cpu", "cpu"])
    b = GPipe(mlp(), [2, 1, 1], devices=["cpu"] * 3)
    assert list(a.state_dict()) == plain_keys
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4)
    torch.testing.assert_close(b(x), model(x))


def test_moving_is_denied_but_dtype_is_allowed() -> None:
    pipe = GPipe(mlp(), [2, 2], devices=["cpu", "cpu"])
    for move in (lambda: pipe.cpu(), lambda: pipe.to("cpu"), lambda: pipe.cuda()):
        with pytest.raises(TypeError, match="denied to move"):
            move()
    pipe.to(torch.float64)
    assert pipe(torch.randn(2, 4, dtype=torch.float64)).dtype == torch.float64


def test_train_step_rejects_mismatched_targets_and_no_grad() -> None:
    pipe = GPipe(mlp(), [2, 2], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match="targets have batch size 3, inputs 4"):
        pipe.train_step(torch.randn(4, 4), torch.randn(3, 4), nn.functional.mse_loss)
    with torch.no_grad(), pytest.raises(RuntimeError, match="needs grad mode"):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)


def test_input_type_error() -> None:
    pipe = GPipe(mlp(), [2, 2], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="expected Tensor or Tuple"):
        pipe("not a tensor")  # type: ignore[arg-type]
