"""What both pipes share (giantpipe.engine.pipe): one set of defaults, the same inference of V,
and a global-norm clip equal to torch's on the plain model."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.spec import DEFAULT_TIMEOUT, PipelineSpec, SpecError
from giantpipe.testing import reference_step, step_seed
from tests.unit.engine.engine_helpers import tuple_batch, tuple_model


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def defaults(cls: type) -> dict[str, object]:
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def test_both_pipes_have_one_set_of_defaults() -> None:
    ours, theirs = defaults(GPipe), defaults(DistributedPipe)
    shared = set(ours) & set(theirs)
    assert {"chunks", "recompute", "schedule", "timeout", "virtual_stages", "spec"} <= shared
    assert {name: ours[name] for name in shared} == {name: theirs[name] for name in shared}
    assert ours["timeout"] == DEFAULT_TIMEOUT == 300.0
    assert GPipe(mlp(), [3, 2], devices=["cpu", "cpu"]).timeout == DEFAULT_TIMEOUT


def test_interleaved_infers_two_virtual_stages() -> None:
    assert PipelineSpec((1, 1, 1, 1), chunks=2, schedule="interleaved").virtual_stages == 2
    assert PipelineSpec((1, 1, 1, 1), chunks=2, schedule="1f1b").virtual_stages == 1
    spec = PipelineSpec((1, 1, 1, 2), chunks=2, recompute="never", schedule="interleaved")
    assert spec.virtual_stages == 2 and spec.num_workers == 2
    pipe = GPipe(mlp(), [1, 1, 1, 2], devices=["cpu", "cpu"], chunks=2, schedule="interleaved")
    assert pipe.virtual_stages == 2 and pipe.num_workers == 2
    with pytest.raises(SpecError, match="multiple of 2"):
        PipelineSpec((2, 2, 1), chunks=2, schedule="interleaved")


def set_grads(model: nn.Module, scales: list[float]) -> None:
    """Gradients whose size differs from layer to layer (so stages' norms differ)."""
    g = torch.Generator().manual_seed(3)
    layers = [m for m in model if isinstance(m, nn.Linear)]
    for layer, scale in zip(layers, scales):
        for p in layer.parameters():
            p.grad = torch.randn(p.shape, generator=g) * scale


@pytest.mark.parametrize("factor", [0.3, 3.0], ids=["above_limit", "below_limit"])
def test_clip_equals_torch_on_the_plain_model(factor: float) -> None:
    plain = mlp()
    pipe = GPipe(copy.deepcopy(plain), [2, 2, 1], devices=["cpu"] * 3)
    scales = [10.0, 0.1, 1.0]  # stage 0 dominates the norm, stage 1 hardly counts
    set_grads(plain, scales)
    set_grads(pipe, scales)
    before = [p.grad.clone() for p in pipe.parameters()]
    stage_norms = [
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in s.parameters()]))
        for s in pipe.partitions
    ]
    assert len({round(float(n), 3) for n in stage_norms}) == 3
    total = float(torch.linalg.vector_norm(torch.stack(stage_norms)))
    limit = total * factor

    ref = torch.nn.utils.clip_grad_norm_(plain.parameters(), limit)
    norm = pipe.clip_grad_norm_(limit)

    assert torch.equal(norm, ref) and norm.item() == pytest.approx(total, rel=1e-6)
    for (name, p), (_, q), old in zip(pipe.named_parameters(), plain.named_parameters(), before):
        assert torch.equal(p.grad, q.grad), name
        if factor > 1:
            assert torch.equal(p.grad, old), name  # below the limit: not touched, bit for bit
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in pipe.parameters()]))
    assert float(clipped) == pytest.approx(min(limit, total), rel=1e-5)


def test_clip_after_a_pipelined_step_matches_the_plain_model() -> None:
    model = tuple_model()
    inputs, target = tuple_batch()
    plain, _ = reference_step(model, inputs, target, 4, step_seed(5))
    pipe = GPipe(copy.deepcopy(model), [2, 2, 2], devices=["cpu"] * 3, chunks=4)
    torch.manual_seed(5)
    pipe.train_step(inputs, target, nn.functional.cross_entropy)

    ref = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    norm = pipe.clip_grad_norm_(0.05)

    assert float(ref) > 0.05  # the limit bites
    torch.testing.assert_close(norm, ref, rtol=1e-5, atol=1e-7)
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
