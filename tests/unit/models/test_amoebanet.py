"""AmoebaNet-D / -B: parameter counts against the GPipe paper, shapes, pipeline boundaries."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.amoebanet import (
    AMOEBANET_B,
    AMOEBANET_D,
    Cell,
    DropPath,
    amoebanet,
    amoebanetb,
    amoebanetd,
    get_genotype,
)

# torchgpipe's AmoebaNet-D reproduces the paper's Table 1 sizes with exactly these counts.
PAPER_COUNTS_D = [
    (18, 208, 81_505_540),
    (18, 416, 319_024_120),
    (18, 544, 542_734_840),
    (36, 544, 1_055_832_376),
    (72, 512, 1_844_858_344),
    (18, 256, 122_470_120),
    (18, 128, 31_694_440),
]
# Counted by this implementation (TF reference genotype); the paper says "557M".
AMOEBANET_B_18_512 = 560_053_608


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("num_layers", "num_filters", "expected"), PAPER_COUNTS_D)
def test_amoebanetd_parameter_counts_match_paper(
    num_layers: int, num_filters: int, expected: int
) -> None:
    with torch.device("meta"):
        model = amoebanet("D", num_layers, num_filters, num_classes=1000)
    assert all(p.is_meta for p in model.parameters())
    assert count(model) == expected
    assert len(model) == num_layers + 6


def test_amoebanetb_parameter_count() -> None:
    with torch.device("meta"):
        model = amoebanetb(num_layers=18, num_filters=512, num_classes=1000)
    assert count(model) == AMOEBANET_B_18_512
    assert abs(count(model) - 557e6) / 557e6 < 0.05


def test_layer_names_and_order() -> None:
    with torch.device("meta"):
        model = amoebanetd(num_layers=6, num_filters=16, num_classes=10)
    names = [name for name, _ in model.named_children()]
    assert names == [
        "stem", "reduce1", "reduce2", "normal1_1", "normal1_2", "reduce3",
        "normal2_1", "normal2_2", "reduce4", "normal3_1", "normal3_2", "classifier",
    ]  # fmt: skip


@pytest.mark.parametrize("genotype", ["D", "B"])
@pytest.mark.parametrize("size", [224, 480])
def test_output_shape(genotype: str, size: int) -> None:
    torch.manual_seed(0)
    model = amoebanet(genotype, num_layers=3, num_filters=16, num_classes=10, image_size=size)
    with torch.no_grad():
        logits = model.eval()(torch.randn(2, 3, size, size))
    assert logits.shape == (2, 10)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("size", [32, 57, 100])
def test_odd_and_small_inputs_run(size: int) -> None:
    model = amoebanet("B", num_layers=3, num_filters=8, num_classes=5).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, size, size)).shape == (1, 5)


@pytest.mark.parametrize("genotype", ["D", "B"])
def test_every_boundary_is_a_current_previous_pair(genotype: str) -> None:
    torch.manual_seed(0)
    model = amoebanet(genotype, num_layers=3, num_filters=16, num_classes=10).eval()
    x: object = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        for i, layer in enumerate(model[:-1]):
            previous_out = x
            x = layer(x)
            assert isinstance(x, tuple) and len(x) == 2, f"layer {i} returned {type(x)}"
            assert all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in x)
            if i > 0:  # a cell passes its input's current on as the next previous
                assert x[1] is previous_out[0]  # type: ignore[index]
        logits = model[-1](x)
    assert logits.shape == (2, 10)


def test_any_cut_gives_the_same_output() -> None:
    torch.manual_seed(0)
    model = amoebanetd(num_layers=3, num_filters=8, num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        full = model(x)
        for cut in range(1, len(model)):
            assert torch.equal(model[cut:](model[:cut](x)), full)


def test_max_pool_is_a_true_max_pool() -> None:
    model = amoebanetd(num_layers=3, num_filters=8, num_classes=10)
    cells = [m for m in model if isinstance(m, Cell)]
    pools = [op for cell in cells for op in cell.ops if isinstance(op, nn.MaxPool2d)]
    # normal cell: two max 3x3; reduction: two max 3x3 and two max 2x2 (3 normal, 4 reduction)
    assert sum(p.kernel_size == 3 for p in pools) == 3 * 2 + 4 * 2
    assert sum(p.kernel_size == 2 for p in pools) == 4 * 2


def test_backward_gives_finite_gradients_everywhere() -> None:
    torch.manual_seed(0)
    model = amoebanetb(num_layers=3, num_filters=8, num_classes=10, image_size=32)
    loss = model(torch.randn(4, 3, 32, 32)).logsumexp(dim=1).mean()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_drop_path_is_off_by_default_and_a_module_when_on() -> None:
    plain = amoebanetd(num_layers=3, num_filters=8, num_classes=10)
    assert not any("DropPath" in type(m).__name__ for m in plain.modules())
    model = amoebanetd(num_layers=3, num_filters=8, num_classes=10, drop_path=0.3)
    assert any(isinstance(m, DropPath) for m in model.modules())
    assert count(model) == count(plain)
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model(x))
        model.train()
        torch.manual_seed(1)
        a = model(x)
        torch.manual_seed(1)
        assert torch.equal(model(x), a)  # replayable from the RNG state


def test_drop_path_keeps_or_drops_whole_examples() -> None:
    torch.manual_seed(0)
    y = DropPath(0.5).train()(torch.ones(64, 3, 2, 2))
    per_example = y.flatten(1)
    assert set(per_example.unique().tolist()) <= {0.0, 2.0}
    assert (per_example == per_example[:, :1]).all()


def test_genotype_names() -> None:
    assert get_genotype("AmoebaNet-D") is AMOEBANET_D
    assert get_genotype("amoebanet_b") is AMOEBANET_B
    assert get_genotype("b") is AMOEBANET_B
    with pytest.raises(ValueError, match="genotype"):
        get_genotype("C")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 4}, "num_layers"),
        ({"num_filters": 12}, "num_filters"),
        ({"num_classes": 0}, "num_classes"),
        ({"image_size": 16}, "image_size"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, int], match: str) -> None:
    args = {"num_layers": 3, "num_filters": 8, "num_classes": 10, "image_size": 32} | kwargs
    with pytest.raises(ValueError, match=match):
        amoebanetd(**args)


def test_batch_norm_momentum_and_eps_as_tf_sets_them() -> None:
    default = amoebanetb(num_layers=3, num_filters=8, num_classes=10, image_size=32)
    tf_like = amoebanetb(3, 8, 10, 32, bn_momentum=3e-4, bn_eps=1e-3)  # TF decay 0.9997
    norms = [m for m in tf_like.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all((m.momentum, m.eps) == (3e-4, 1e-3) for m in norms)
    assert all(
        (m.momentum, m.eps) == (0.1, 1e-5)
        for m in default.modules()
        if isinstance(m, nn.BatchNorm2d)
    )
    assert sum(p.numel() for p in tf_like.parameters()) == sum(
        p.numel() for p in default.parameters()
    )
    with pytest.raises(ValueError, match="bn_momentum"):
        amoebanetd(3, 8, 10, 32, bn_momentum=1.5)


@pytest.mark.slow
def test_small_amoebanetd_learns_generated_images() -> None:
    from giantpipe.data.images.generated import GeneratedImages
    from giantpipe.data.images.loaders import build_image_loader

    torch.manual_seed(0)
    model = amoebanetd(num_layers=3, num_filters=8, num_classes=10, image_size=32)
    train = GeneratedImages(size=80 * 32, image_size=32, num_classes=10, seed=0)
    held_out = GeneratedImages(size=500, image_size=32, num_classes=10, seed=1)
    loader = build_image_loader(train, batch_size=32, shuffle=True, num_workers=0, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for images, labels in loader:  # 80 steps
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    images, labels = next(iter(build_image_loader(held_out, 500, shuffle=False, num_workers=0)))
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
    print(f"held-out accuracy after 80 steps: {accuracy:.3f} (chance 0.100)")
    assert accuracy > 0.4
