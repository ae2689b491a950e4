"""What each rank runs in the tests of a stage spread over its replicas on FSDP2 (test_replicas.py).

Every check compares a rank's share of the :class:`DistributedPipe` (its shard of every
gradient and buffer, see ``workers.assert_matches``) with the plain model on the whole
mini-batch: every replica's shard, micro-batch by micro-batch, dropout seeded as the engine
seeds each replica.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor, Replicate, Shard

from giantpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.distributed.replicas import local_tensor
from giantpipe.engine.recompute import recompute_stop
from giantpipe.perf.balance import solve_balance
from giantpipe.testing import step_seed
from tests.distributed.workers import (
    INIT,
    SEED,
    assert_matches,
    model_fn,
    plain_model,
    registered_schedules,
    virtual_stages_for,
)
from tests.support.shards import reference, shard
from tests.timeouts import scaled
from tests.unit.engine.engine_helpers import tuple_batch

RECOMPUTE = ["except_last", "always", "never"]


@contextlib.contextmanager
def counted_collectives() -> Iterator[dict[str, int]]:
    """Counts FSDP2's all-gathers and reduces (reduce-scatter or all-reduce, one per unit and
    call) while it is open."""
    counts = {"gathers": 0, "reduces": 0}
    gather, reduce = _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce

    def gathering(*args: Any, **kwargs: Any) -> Any:
        counts["gathers"] += 1
        return gather(*args, **kwargs)

    def reducing(*args: Any, **kwargs: Any) -> Any:
        counts["reduces"] += 1
        return reduce(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = gathering
    _fsdp_param_group.foreach_reduce = reducing
    try:
        yield counts
    finally:
        _fsdp_param_group.foreach_all_gather = gather
        _fsdp_param_group.foreach_reduce = reduce


def check_spread(pipe: DistributedPipe, sharding: str, what: str) -> int:
    """Every parameter of the rank is a DTensor on its replica mesh, sharded on dim 0 (``full``,
    ``grads``) or replicated (``none``); returns the elements this rank holds."""
    held = 0
    for name, p in pipe.named_parameters():
        assert isinstance(p, DTensor), f"{what}: {name} is not on FSDP2"
        assert p.device_mesh.size() == pipe.replicas, f"{what}: {name} on {p.device_mesh}"
        kind = Replicate if sharding == "none" else Shard
        assert all(isinstance(q, kind) for q in p.placements), f"{what}: {name} {p.placements}"
        held += p.to_local().numel()
    return held


def gathers(sharding: str, schedule: str, chunks: int, mode: str) -> int:
    """All-gathers per unit in one step (replicas.py's docstring): none replicated; one with
    ``grads``, and with ``full`` under zero bubble (W needs the graph B kept); else FSDP2's
    ZeRO-3, one per forward, recompute and backward of each micro-batch."""
    if sharding == "none":
        return 0
    if sharding == "grads" or schedule.startswith("zb"):
        return 1
    return 2 * chunks + recompute_stop(mode, chunks)


def reduces(sharding: str, schedule: str, chunks: int) -> int:
    """Reduces per unit in one step: with ``full`` (not zero bubble) FSDP2's ZeRO-3, one after
    each micro-batch's backward, into the sharded gradient; else one, after the stage's last
    B or W (the gradients accumulated unsharded until then)."""
    if sharding == "full" and not schedule.startswith("zb"):
        return chunks
    return 1


def grid(
    tmp: Path,
    workers: int,
    shardings: list[str],
    chunks: int = 4,
    schedules: list[str] | None = None,
    blocks: int = 6,
) -> dict[str, Any]:
    """One step per (sharding, schedule; the recompute mode turning over): the loss, this
    rank's shard of every gradient and the deferred BatchNorm statistics equal the plain model
    on the whole mini-batch; the reduces of :func:`reduces` and the all-gathers of
    :func:`gathers`."""
    replicas = dist.get_world_size() // workers
    model = convert_deferred_batch_norm(plain_model(blocks))
    inputs, target = tuple_batch(n=8 * replicas)
    shards = [(shard(inputs, r, replicas), shard(target, r, replicas)) for r in range(replicas)]
    plain, ref_loss = reference(model, shards, chunks, step_seed(SEED))
    commit_deferred_batch_norm(plain)
    checked, case = [], 0
    for sharding in shardings:
        for name in schedules or registered_schedules():
            v = virtual_stages_for(name, workers, chunks)
            if v is None or workers * v > len(model):
                continue
            mode = RECOMPUTE[case % len(RECOMPUTE)]
            case += 1
            what = f"{sharding} {name} K={workers} V={v} R={replicas} M={chunks} {mode}"
            pipe = DistributedPipe(
                model_fn(blocks),
                solve_balance([1.0] * len(model), workers * v),
                chunks=chunks,
                recompute=mode,
                schedule=name,
                virtual_stages=v,
                deferred_batch_norm=True,
                seed=INIT,
                timeout=scaled(20),
                replica_sharding=sharding,
            )
            held = check_spread(pipe, sharding, what)
            assert pipe.shards is not None
            units = len(pipe.shards.units)
            x, y = shards[pipe.replica]
            torch.manual_seed(SEED)
            with counted_collectives() as counts:
                loss = pipe.train_step(
                    x if pipe.needs_inputs else None,
                    y if pipe.needs_targets else None,
                    nn.functional.cross_entropy,
                )
            assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (what, loss, ref_loss)
            n = assert_matches(pipe, plain, what, buffers=True)
            expected = {
                "gathers": gathers(sharding, name, chunks, mode) * units,
                "reduces": reduces(sharding, name, chunks) * units,
            }
            assert counts == expected, (what, counts, units)
            assert all(isinstance(p, DTensor) for p in pipe.parameters()), f"{what}: resharded"
            checked.append((what, n, held))
            pipe.release()
    return {"checked": checked}


def tied(tmp: Path, workers: int, schedule: str, sharding: str = "full") -> dict[str, Any]:
    """A weight tied across the first and last stage (on two ranks, or on one): every rank's
    shard of every gradient equals the plain model's (the tied one summed over both uses),
    two SGD steps keep the copies equal, and the clip counts the tied weight once."""
    from tests.distributed.gpu_rules_workers import tied_model, toy_data

    replicas = dist.get_world_size() // workers
    plain = convert_deferred_batch_norm(tied_model())
    from giantpipe.engine.meta import init_layers

    init_layers(plain, INIT)
    v = virtual_stages_for(schedule, workers, 2) or 1
    pipe = DistributedPipe(
        tied_model,
        solve_balance([1.0] * len(plain), workers * v),
        chunks=2,
        schedule=schedule,
        virtual_stages=v,
        deferred_batch_norm=True,
        seed=INIT,
        timeout=scaled(20),
        replica_sharding=sharding,
    )
    pipe_opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    norms = []
    for step in range(2):
        inputs, target = toy_data(step)
        shards = [(shard(inputs, r, replicas), shard(target, r, replicas)) for r in range(replicas)]
        _, ref_loss = reference(plain, shards, 2, step_seed(SEED + step), accumulate=True)
        commit_deferred_batch_norm(plain)
        x, y = shards[pipe.replica]
        torch.manual_seed(SEED + step)
        loss = pipe.train_step(
            x if pipe.needs_inputs else None,
            y if pipe.needs_targets else None,
            nn.functional.cross_entropy,
        )
        assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (step, loss, ref_loss)
        ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        norm = pipe.clip_grad_norm_(0.05)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
        norms.append(float(norm))
        assert_matches(pipe, plain, f"tied {schedule} step {step}", buffers=True)
        pipe_opt.step()
        plain_opt.step()
        pipe_opt.zero_grad()
        plain_opt.zero_grad()
    want = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(
            local_tensor(p.detach()), _mine(want[name].detach(), p), msg=f"weights: {name}"
        )
    held = len(pipe.tied.held)
    pipe.release()
    return {"norms": norms, "tied": held}


def several(tmp: Path, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Runs several of these checks in one launch, in order; their results in that order."""
    results = []
    for index, (name, kwargs) in enumerate(calls):
        sub = tmp / f"{index}-{name}"
        sub.mkdir(exist_ok=True)
        results.append(globals()[name](sub, **kwargs))
    return results


def _mine(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    from tests.distributed.workers import mine

    return mine(value, like)


def resume_across_layouts(tmp: Path, steps: int = 4, resume_at: int = 2) -> dict[str, Any]:
    """The runner on K=2 x R=2 with ``full`` sharding (AdamW, an EMA), saving at ``resume_at``;
    then that checkpoint resumed under K=1 x R=4 ``grads``, K=4 x R=1 (no FSDP2) and K=2 x R=2
    ``none``. Rank 0 returns each run's train and eval losses, and the first run's last
    weights, gathered whole (what consolidate must give)."""
    from dataclasses import replace
    from unittest import mock

    from giantpipe.config import PipelineConfig
    from giantpipe.engine.distributed.replicas import whole_tensor
    from giantpipe.metrics.jsonl import read_jsonl
    from giantpipe.runner import build as runner_build
    from giantpipe.runner import train
    from tests.support.runs import tiny

    cfg = tiny(
        max_steps=steps,
        eval_every=steps,
        log_every=1,
        checkpoint_every=resume_at,
        predict=False,
        ema_decay=0.5,
    )
    cfg.model = replace(cfg.model, norm="none")

    def pipeline(k: int, sharding: str) -> PipelineConfig:
        return PipelineConfig(
            devices="cpu",
            num_devices=k,
            chunks=2,
            executor="distributed",
            balance="params",
            replica_sharding=sharding,
        )

    checkpoint = str(tmp / "run" / f"step_{resume_at}")
    runs = {"run": replace(cfg, pipeline=pipeline(2, "full"))}
    others = [("k1r4_grads", 1, "grads"), ("k4r1", 4, "full"), ("k2r2_none", 2, "none")]
    for name, k, sharding in others:
        trainer = replace(cfg.trainer, resume=checkpoint)
        runs[name] = replace(cfg, trainer=trainer, pipeline=pipeline(k, sharding))
    out: dict[str, Any] = {}
    built: list[Any] = []
    real_build = runner_build.build_experiment

    def keep(*args: Any, **kwargs: Any) -> Any:
        parts = real_build(*args, **kwargs)
        built.append(parts)
        return parts

    # The runner leaves the world at the end; the launcher does that here, after the result.
    with (
        mock.patch.object(dist, "destroy_process_group", lambda *_, **__: None),
        mock.patch("giantpipe.runner.run.build_experiment", keep),
    ):
        for name, run_cfg in runs.items():
            summary = train(run_cfg, tmp / name, "")
            assert summary["status"] == "completed", summary
            if name == "run":
                pipe = built[-1].pipe
                whole = {k: whole_tensor(v.detach()) for k, v in pipe.state_dict().items()}
                out["weights"] = whole if pipe.replica == 0 else {}
            dist.barrier()
            if dist.get_rank() == 0:
                lines = read_jsonl(tmp / name / "metrics.jsonl")
                out[name] = {
                    "train": [r["loss"] for r in lines if r["kind"] == "train"],
                    "eval": [r["loss"] for r in lines if r["kind"] == "eval"],
                }
    return out


def memory(tmp: Path, workers: int, shardings: list[str]) -> dict[str, float]:
    """Two AdamW steps per mode; this rank's parameters + gradients + optimizer state (by the
    storages they live in: a shard counts its part) over the same stage's un-sharded bytes."""
    from giantpipe.testing.held import training_bytes

    model = plain_model(6)
    balance = solve_balance([1.0] * len(model), workers)
    inputs, target = tuple_batch(n=16)
    ratios = {}
    for sharding in shardings:
        pipe = DistributedPipe(
            model_fn(6), balance, chunks=2, seed=INIT, timeout=scaled(20), replica_sharding=sharding
        )
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        x, y = (shard(t, pipe.replica, pipe.replicas) for t in (inputs, target))
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            pipe.train_step(x, y, nn.functional.cross_entropy)
            opt.step()
        held = sum(training_bytes(pipe.parameters(), opt).values())
        whole = sum(p.numel() * p.element_size() for p in pipe.parameters())  # global shapes
        ratios[sharding] = held / (whole * 4)  # weights, gradients, AdamW's two moments
        pipe.release()
    return ratios
