"""What each rank runs in tests/distributed/test_eval_batch.py: evaluation batches smaller than
M (the last batch of an evaluation set, or a replica's empty share of it) through a
DistributedPipe, against the plain model in eval mode, then a training step at M."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.microbatch import forward_chunks
from giantpipe.perf.balance import solve_balance
from giantpipe.testing import step_seed
from tests.distributed.workers import INIT, SEED, assert_matches, model_fn, plain_model
from tests.support.shards import reference
from tests.timeouts import scaled
from tests.unit.engine.engine_helpers import tuple_batch

CHUNKS = 4
SIZES = (1, 3, 0, 5, 2)  # short batches in turn (their layouts change from call to call)


def short_batches(
    tmp: Path, schedule: str = "gpipe", virtual_stages: int | None = None
) -> dict[str, Any]:
    """``pipe(x)`` and ``eval_step`` on batches of SIZES at M=4 equal the plain model (every rank
    runs min(M, batch) micro-batches, one empty one for an empty batch); then a training step
    of 8 samples at M=4 equals the plain model's, the pipe unharmed."""
    model = plain_model(2)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # distinct running statistics, so the eval-mode BatchNorm matters
        for layer in model[1:-1]:
            layer.bn.running_mean.copy_(torch.rand(layer.bn.num_features, generator=g) - 0.5)
            layer.bn.running_var.copy_(torch.rand(layer.bn.num_features, generator=g) + 0.5)
    stages = 2 * (virtual_stages or 1)
    pipe = DistributedPipe(
        model_fn(2),
        solve_balance([1.0] * len(model), stages),
        chunks=CHUNKS,
        schedule=schedule,
        virtual_stages=virtual_stages,
        seed=INIT,
        timeout=scaled(20),
    )
    pipe.load_state_dict(model.state_dict())
    model.eval()
    pipe.eval()
    (x, mask), y = tuple_batch(n=8)
    counts = []
    for n in SIZES:
        inputs = (x[:n], mask[:n])
        with torch.no_grad():
            expected = model(inputs)
        out = pipe(inputs if pipe.needs_inputs else None)
        counts.append(pipe.last_stats.chunks if pipe.last_stats else -1)
        if pipe.needs_targets:
            assert out is not None and out.shape == expected.shape == (n, 3), (n, out)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=f"batch {n}")
        else:
            assert out is None
        if n == 0:
            continue  # a mean over no sample has no value (the loss normaliser is 0)
        loss = pipe.eval_step(
            inputs if pipe.needs_inputs else None,
            y[:n] if pipe.needs_targets else None,
            nn.functional.cross_entropy,
        )
        torch.testing.assert_close(loss, nn.functional.cross_entropy(expected, y[:n]))
    assert counts == [forward_chunks(n, CHUNKS) for n in SIZES], counts
    model.train()
    pipe.train()
    plain, ref_loss = reference(copy.deepcopy(model), [((x, mask), y)], CHUNKS, step_seed(SEED))
    torch.manual_seed(SEED)
    loss = pipe.train_step(
        (x, mask) if pipe.needs_inputs else None,
        y if pipe.needs_targets else None,
        nn.functional.cross_entropy,
    )
    assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    return {"counts": counts, "checked": assert_matches(pipe, plain, "after short evaluations")}


def several(tmp: Path, calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each call's ``short_batches`` in one launch, keyed by its name."""
    results = {}
    for name, kwargs in calls:
        sub = tmp / name
        sub.mkdir(exist_ok=True)
        results[name] = short_batches(sub, **kwargs)
    return results


def replica_shares(tmp: Path) -> dict[str, Any]:
    """The runner's evaluation at K = 2 x R = 2 with FSDP2's ``full`` over batches whose
    replica shares differ in size (one of them empty): the figures of the plain model in one
    process. Each replica's forward runs as many micro-batches as the other's, since FSDP2
    gathers the layers per micro-batch, a collective of the replicas."""
    from giantpipe.data.bundle import DataBundle
    from giantpipe.runner.evaluate import evaluate
    from giantpipe.runner.world import TorchrunWorld

    model = plain_model(2)
    pipe = DistributedPipe(
        model_fn(2), [2, 2], chunks=CHUNKS, seed=INIT, timeout=20, replica_sharding="full"
    )
    (x, mask), y = tuple_batch(n=11)
    batches = [((x[a:b], mask[a:b]), y[a:b]) for a, b in [(0, 3), (3, 4), (4, 9), (9, 11)]]
    bundle = DataBundle(
        train_batches=lambda seed, position: iter([]),
        eval_batches=lambda: batches,
        batches_per_epoch=1,
    )
    world = TorchrunWorld(20.0)
    world.bind(pipe)
    got = evaluate(pipe, bundle, None, "fp32", [str(pipe.device)], world)
    return {"got": got, "plain": evaluate(model, bundle, None, "fp32", ["cpu"])}
