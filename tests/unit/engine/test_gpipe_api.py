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


# ---- the rest of torchgpipe's public behaviour ------------------------------------------------


class NotATensor(nn.Module):
    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> object:
        return self.value


@pytest.mark.parametrize("door", ["forward", "no_grad", "train_step"])
@pytest.mark.parametrize("value", ["hello", {"a": 1}, None, (1, 2)], ids=repr)
def test_a_layer_returning_a_non_tensor_raises_type_error(door: str, value: object) -> None:
    model = nn.Sequential(nn.Linear(4, 4), NotATensor(value), nn.Linear(4, 4))
    pipe = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 4)
    with pytest.raises(
        TypeError,
        match="expected Tensor or Tuple\\[Tensor, ...\\] from stage 0, "
        f"but got {type(value).__name__}",
    ) as info:
        if door == "forward":
            pipe(x)
        elif door == "no_grad":
            with torch.no_grad():
                pipe(x)
        else:
            pipe.train_step(x, torch.randn(4, 4), nn.functional.mse_loss)
    assert info.value.__notes__ == [
        "giantpipe: stage 0 (device cpu) failed on micro-batch 0 (forward)"
    ]


def test_a_tuple_output_may_carry_non_tensors() -> None:
    # giantpipe's extension: masks, ints and None ride along a tuple, even out of the last stage.
    model = nn.Sequential(nn.Linear(4, 4), NotATensor(None))
    model[1].forward = lambda x: (x, 3, None)  # type: ignore[method-assign]
    pipe = GPipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    y, three, none = pipe(torch.randn(4, 4))
    assert y.shape == (4, 4) and three == 3 and none is None
    y.sum().backward()


def test_verify_module_is_public_and_raises_as_torchgpipe() -> None:
    import giantpipe
    from giantpipe.engine.gpipe import verify_module  # where torchgpipe keeps it

    assert giantpipe.verify_module is verify_module
    shared = nn.Linear(2, 2)
    cases = [
        (nn.Linear(2, 2), TypeError, "module must be nn.Sequential to be partitioned"),
        (nn.Sequential(shared, shared), ValueError, "module with duplicate children"),
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), None, ""),
    ]
    theirs = pytest.importorskip("torchgpipe.gpipe").verify_module
    for module, exc, message in cases:
        for verify in (giantpipe.verify_module, theirs):
            if exc is None:
                verify(module)
                continue
            with pytest.raises(exc, match=message):
                verify(module)


@pytest.mark.parametrize("devices", [["cpu"], None])
def test_an_empty_sequential_pipes_as_the_identity(devices: list[str] | None) -> None:
    pipe = GPipe(nn.Sequential(), [], devices=devices, chunks=2)
    x = torch.randn(4, 3, requires_grad=True)
    assert pipe(x) is x
    pair = (x, torch.zeros(4, dtype=torch.long))
    assert pipe(pair) is pair
    with pytest.raises(TypeError, match="expected Tensor or Tuple"):
        pipe("x")  # type: ignore[arg-type]
    assert len(pipe) == 0 and list(pipe) == [] and pipe.partitions == []
    y = torch.randn(4, 3)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, nn.functional.mse_loss(x, y).detach())
    assert x.grad is not None
    torchgpipe = pytest.importorskip("torchgpipe")
    assert torchgpipe.GPipe(nn.Sequential(), [], devices=["cpu"])(x) is x


def test_chunks_as_an_integral_float_and_checkpoint_as_a_str_like_object() -> None:
    class Mode:
        def __str__(self) -> str:
            return "never"

    pipe = GPipe(mlp(), [2, 2], devices=["cpu", "cpu"], chunks=2.0, checkpoint=Mode())  # type: ignore[arg-type]
    assert pipe.chunks == 2 and type(pipe.chunks) is int
    assert pipe.checkpoint == "never" and type(pipe.checkpoint) is str
    pipe(torch.randn(4, 4)).sum().backward()
    with pytest.raises(ValueError, match="number of chunks must be positive integer"):
        GPipe(mlp(), [2, 2], devices=["cpu", "cpu"], chunks=2.5)  # type: ignore[arg-type]


def test_a_torchgpipe_state_dict_loads() -> None:
    torchgpipe = pytest.importorskip("torchgpipe")
    model = mlp()
    theirs = torchgpipe.GPipe(copy.deepcopy(model), [1, 3], devices=["cpu", "cpu"])
    saved = theirs.state_dict()
    assert "partitions.1.3.weight" in saved  # torchgpipe's names: partition, then layer
    ours = GPipe(mlp(), [2, 1, 1], devices=["cpu"] * 3)
    ours.load_state_dict(saved)  # strict: every key placed
    assert list(ours.state_dict()) == list(model.state_dict())  # ours stay plain
    x = torch.randn(3, 4)
    torch.testing.assert_close(ours(x), model(x))
    wrapped = nn.Sequential(ours)  # under a prefix too
    wrapped.load_state_dict({f"0.{k}": v for k, v in saved.items()})
