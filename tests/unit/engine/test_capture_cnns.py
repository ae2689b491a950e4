"""sequentialize on the common torchvision CNNs, default cut: MobileNetV3-S, EfficientNet-B0,
DenseNet-121, ResNet-50, ConvNeXt-T and Swin-T (random weights, 32-pixel images, nothing
downloaded). Each piece runs on its own leaf input (as a stage's first piece does, and as
``balance_by_time`` profiles it: in-place ops such as ``relu_`` and ``hardswish_`` right after a
cut must not touch it), and a K=2 step (micro-batches of 4, BatchNorm in training mode) equals
the original model: loss exactly, every gradient by the model's own names at rtol 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from giantpipe import GPipe, sequentialize
from giantpipe.engine.capture.cuts import repeated_blocks
from giantpipe.perf.balance import profile_times

torchvision = pytest.importorskip("torchvision")

# pieces of the default cut: the repeated blocks, the stem before them and the head after them
PIECES = {
    "mobilenet_v3_small": 14,  # features.0 .. features.12, head (not the classifier's layers)
    "efficientnet_b0": 16,
    "densenet121": 13,
    "resnet50": 18,
    "convnext_tiny": 23,  # stem, 18 blocks, 3 downsamplings, head
    "swin_t": 17,  # stem, 12 blocks, 3 patch mergings, head
}
# the stage boundary: where stage 1 starts (DenseNet's: relu0, an in-place ReLU after a cut)
FIRST_OF_STAGE_1 = {"densenet121": 2}
BATCH, CHUNKS = 8, 2


def cnn(name: str) -> torch.nn.Module:
    """The model, its dropout and stochastic depth off: the original would draw other random
    numbers than the pipeline's seeded stages (their replay is test_capture_models.py's)."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=10)
    for module in model.modules():
        if isinstance(module, (torch.nn.Dropout, torchvision.ops.StochasticDepth)):
            module.p = 0.0
    return model


class InPlaceBlock(torch.nn.Module):
    """Starts with an in-place ReLU on its input (as torchvision's ReLU(inplace=True) after a
    cut), and changes a view of a value in place (which must stay in place: the base is read)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(F.relu(x, inplace=True))
        h[:, :2].mul_(2.0)  # through a view: h itself changes
        return torch.nn.functional.hardswish(h, inplace=True) + h


class InPlaceNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 6)
        self.blocks = torch.nn.ModuleList([InPlaceBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_piece_that_starts_with_an_in_place_op_runs_on_a_leaf() -> None:
    torch.manual_seed(0)
    model, x = InPlaceNet(), torch.randn(6, 4)
    seq = sequentialize(model, x)
    assert len(seq) == 3  # stem, block, block (each block's piece opens with relu_)
    for piece, input_ in zip(seq, [x, model.stem(x), model.blocks[0](model.stem(x))]):
        leaf = input_.detach().requires_grad_()  # a stage's input, balance_by_time's sample
        piece(leaf).sum().backward()
        assert leaf.grad is not None
    for p in model.parameters():
        p.grad = None
    (model(x).sum() / 2).backward()  # the step's loss: the micro-batches' mean
    pipe = GPipe(copy.deepcopy(seq), [1, 2], chunks=2)
    pipe.train_step(x, torch.zeros(6, 6), lambda out, _: out.sum())
    mine = dict(pipe.state_dict(keep_vars=True))
    for key, p in model.named_parameters():
        torch.testing.assert_close(mine[key].grad, p.grad, msg=key)


def test_blocks_inside_sequential_subclasses_are_found() -> None:
    groups = repeated_blocks(cnn("mobilenet_v3_small"))
    assert groups == [[f"features.{i}" for i in range(13)]]  # Conv2dNormActivation is a block


# Images have one size: captured as the runner captures them (only the batch dimension
# symbolic), and once with every dimension symbolic, the default (Swin-T would take 2 minutes).
CASES = [(name, "batch") for name in PIECES] + [("mobilenet_v3_small", "all")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dynamic"), CASES)
def test_cnn_default_cut_pipelined_equals_the_original(name: str, dynamic: str) -> None:
    # Each CNN is a unit of its own on xdist (tests/conftest.py SPREAD): they spread.
    model = cnn(name)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 3, 32, 32, generator=g), torch.arange(BATCH) % 10
    seq = sequentialize(model, x[:2], dynamic=dynamic)
    assert len(seq) == PIECES[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker: convolutions then add up in the same order
    try:
        profile_times(seq, x[:2], torch.device("cpu"), repeats=1)  # each piece on a leaf
        plain = copy.deepcopy(model)
        losses = [
            F.cross_entropy(plain(xm), ym) for xm, ym in zip(x.chunk(CHUNKS), y.chunk(CHUNKS))
        ]
        (sum(losses) / CHUNKS).backward()
    finally:
        torch.set_num_threads(threads)
    first = FIRST_OF_STAGE_1.get(name, len(seq) // 2)
    pipe = GPipe(copy.deepcopy(seq), [first, len(seq) - first], chunks=CHUNKS, threads_per_worker=1)
    loss = pipe.train_step(x, y, F.cross_entropy)
    assert loss.item() == (sum(losses) / CHUNKS).item()
    mine = dict(pipe.state_dict(keep_vars=True))
    for key, p in plain.named_parameters():
        torch.testing.assert_close(mine[key].grad, p.grad, rtol=1e-5, atol=1e-6, msg=key)
    for key, buf in plain.state_dict().items():  # BatchNorm's running statistics too
        torch.testing.assert_close(pipe.state_dict()[key], buf, msg=key)


class Raises(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad layer")


def test_a_layer_that_fails_alone_is_named_while_profiling() -> None:
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), Raises())
    with pytest.raises(ValueError, match="bad layer") as caught:
        profile_times(seq, torch.randn(2, 4), torch.device("cpu"), repeats=1)
    assert "giantpipe: while profiling layer 1 (Raises) alone" in caught.value.__notes__
