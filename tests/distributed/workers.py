"""What each rank runs in the distributed tests (imported by spawned processes and torchrun).

Every check compares a rank's share of the :class:`DistributedPipe` with the same step taken by
the plain model (micro-batch by micro-batch, dropout seeded as the engine seeds it) and by the
local executor (``GPipe``, one process, threads), on this rank's parameter names only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from giantpipe import GPipe
from giantpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from giantpipe.engine.distributed.clipping import clip_grad_norm_
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.distributed.replicas import local_tensor, whole_tensor
from giantpipe.engine.meta import init_layers
from giantpipe.engine.schedules import build_schedule
from giantpipe.perf.balance import solve_balance
from giantpipe.testing import step_seed
from tests.support.shards import reference, shard
from tests.timeouts import scaled
from tests.unit.engine.engine_helpers import tuple_batch, tuple_model

SEED = 5  # torch.manual_seed before each step: the step seed rank 0 draws
INIT = 3  # layer initialisation seed


def registered_schedules() -> list[str]:
    """Every schedule the engine knows now (others may be added later)."""
    from giantpipe.engine import schedules

    return sorted(schedules.schedule_builders())


def virtual_stages_for(name: str, workers: int, chunks: int) -> int | None:
    """The smallest V the schedule accepts for (K, M), or None if it takes none."""
    for v in (1, 2):
        try:
            build_schedule(name, workers, chunks, v)
            return v
        except ValueError:
            continue
    return None


def model_fn(blocks: int) -> Callable[[], nn.Sequential]:
    return lambda: tuple_model(num_blocks=blocks)


def plain_model(blocks: int) -> nn.Sequential:
    model = tuple_model(num_blocks=blocks)
    init_layers(model, INIT)
    return model


def mine(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) as this rank holds ``like``: its FSDP2 shard when ``like``
    is a DTensor (sliced here, no communication), else itself."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(
        value.detach(), like.device_mesh, like.placements, src_data_rank=None
    ).to_local()


def assert_matches(pipe: nn.Module, plain: nn.Module, what: str, buffers: bool = True) -> int:
    """This rank's gradients (and buffers) equal the plain model's; returns how many. Under
    FSDP2 each rank compares its shard of every gradient (the replicas' shards make the
    whole gradient), without a collective that a failing rank would leave hanging. A tied
    weight is compared under whichever of its names this rank holds."""
    want = dict(plain.named_parameters(remove_duplicate=False))
    count = 0
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(
            local_tensor(p.grad),
            mine(want[name].grad, p.grad),
            rtol=1e-4,
            atol=1e-5,
            msg=f"{what}: {name}",
        )
        count += 1
    if buffers:
        plain_buffers = dict(plain.named_buffers())
        for name, b in pipe.named_buffers():
            torch.testing.assert_close(
                b, plain_buffers[name], rtol=1e-5, atol=1e-6, msg=f"{what}: buffer {name}"
            )
    return count


def equivalence(
    tmp: Path,
    workers: int,
    chunks: list[int],
    modes: list[str],
    blocks: int = 6,
    schedules: list[str] | None = None,
    batch: int = 16,
    sharding: str = "full",
) -> dict[str, Any]:
    """One step per (schedule, M, mode): loss and gradients equal plain and GPipe."""
    replicas = dist.get_world_size() // workers
    model = plain_model(blocks)
    inputs, target = tuple_batch(n=batch)
    shards = [(shard(inputs, r, replicas), shard(target, r, replicas)) for r in range(replicas)]
    checked = []
    for name in schedules or registered_schedules():
        for m in chunks:
            v = virtual_stages_for(name, workers, m)
            if v is None or workers * v > len(model):
                continue
            balance = solve_balance([1.0] * len(model), workers * v)
            plain, ref_loss = reference(model, shards, m, step_seed(SEED))
            local = None
            if replicas == 1:
                local = GPipe(
                    copy.deepcopy(model),
                    balance,
                    devices=["cpu"] * workers,
                    chunks=m,
                    schedule=name,
                    virtual_stages=v,
                    checkpoint=modes[0],
                )
                torch.manual_seed(SEED)
                local_loss = local.train_step(inputs, target, nn.functional.cross_entropy)
                assert abs(local_loss.item() - ref_loss) < 1e-5 * abs(ref_loss)
            for mode in modes:
                what = f"{name} K={workers} V={v} R={replicas} M={m} {mode}"
                pipe = DistributedPipe(
                    model_fn(blocks),
                    balance,
                    chunks=m,
                    recompute=mode,
                    schedule=name,
                    virtual_stages=v,
                    seed=INIT,
                    timeout=scaled(20),
                    replica_sharding=sharding,
                )
                x, y = shards[pipe.replica]
                torch.manual_seed(SEED)
                loss = pipe.train_step(
                    x if pipe.needs_inputs else None,
                    y if pipe.needs_targets else None,
                    nn.functional.cross_entropy,
                )
                assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (what, loss, ref_loss)
                n = assert_matches(pipe, plain, what, buffers=replicas == 1)
                if local is not None:
                    assert_matches(pipe, local, what + " vs GPipe", buffers=True)
                stats = pipe.last_stats
                assert stats is not None and len(stats.busy_time_s) == workers, what
                assert len(stats.recompute_time_s) == workers, what  # gathered per rank
                checked.append((what, n))
    return {"checked": checked}


def replicated_batch_norm(tmp: Path, workers: int, chunks: int = 2) -> dict[str, Any]:
    """Deferred BatchNorm under R replicas: every replica commits the whole batch's statistics."""
    replicas = dist.get_world_size() // workers
    model = convert_deferred_batch_norm(plain_model(4))
    inputs, target = tuple_batch(n=16)
    shards = [(shard(inputs, r, replicas), shard(target, r, replicas)) for r in range(replicas)]
    plain, _ = reference(model, shards, chunks, step_seed(SEED))
    commit_deferred_batch_norm(plain)
    pipe = DistributedPipe(
        model_fn(4),
        solve_balance([1.0] * len(model), workers),
        chunks=chunks,
        deferred_batch_norm=True,
        seed=INIT,
        timeout=scaled(20),
    )
    x, y = shards[pipe.replica]
    torch.manual_seed(SEED)
    pipe.train_step(
        x if pipe.needs_inputs else None,
        y if pipe.needs_targets else None,
        nn.functional.cross_entropy,
    )
    checked = assert_matches(pipe, plain, f"deferred BN R={replicas}", buffers=True)
    return {"checked": checked, "buffers": sum(1 for _ in pipe.buffers())}


def accumulation(tmp: Path, workers: int, steps: int = 2) -> dict[str, Any]:
    """Gradients of several steps accumulate in p.grad exactly as in the plain model."""
    replicas = dist.get_world_size() // workers
    plain = copy.deepcopy(plain_model(4))
    balance = solve_balance([1.0] * len(plain), workers)
    pipe = DistributedPipe(model_fn(4), balance, chunks=2, seed=INIT, timeout=scaled(20))
    for step in range(steps):
        inputs, target = toy_data(step)
        shards = [(shard(inputs, r, replicas), shard(target, r, replicas)) for r in range(replicas)]
        reference(plain, shards, 2, step_seed(SEED + step), accumulate=True)
        x, y = shards[pipe.replica]
        torch.manual_seed(SEED + step)
        pipe.train_step(x, y, nn.functional.cross_entropy)  # no zero_grad in between
    return {"checked": assert_matches(pipe, plain, f"{steps} accumulated steps", buffers=False)}


def clipping(tmp: Path, workers: int, max_norm: float = 0.05) -> dict[str, Any]:
    """clip_grad_norm_ over every stage and replica equals torch's on the plain model."""
    replicas = dist.get_world_size() // workers
    model = plain_model(4)
    inputs, target = tuple_batch(n=16)
    shards = [(shard(inputs, r, replicas), shard(target, r, replicas)) for r in range(replicas)]
    plain, _ = reference(model, shards, 2, step_seed(SEED))
    ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
    balance = solve_balance([1.0] * len(model), workers)
    pipe = DistributedPipe(model_fn(4), balance, chunks=2, seed=INIT, timeout=scaled(20))
    x, y = shards[pipe.replica]
    torch.manual_seed(SEED)
    pipe.train_step(x, y, nn.functional.cross_entropy)
    norm = clip_grad_norm_(pipe, max_norm)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
    assert_matches(pipe, plain, "clipped", buffers=False)
    # The method is the same collective: the norm is now the limit, and nothing moves again.
    again = pipe.clip_grad_norm_(10 * max_norm)
    torch.testing.assert_close(again, torch.tensor(max_norm), rtol=1e-4, atol=1e-6)
    assert_matches(pipe, plain, "clipped, then below the limit", buffers=False)
    return {"norm": float(norm)}


def clipping_under_the_limit(tmp: Path, workers: int) -> dict[str, Any]:
    """A limit above the global norm: clip_grad_norm_ returns the norm of every stage and
    replica (torch's on the plain model) and leaves every gradient bit for bit as it was."""
    replicas = dist.get_world_size() // workers
    model = plain_model(4)
    inputs, target = tuple_batch(n=16)
    shards = [(shard(inputs, r, replicas), shard(target, r, replicas)) for r in range(replicas)]
    plain, _ = reference(model, shards, 2, step_seed(SEED))
    ref_norm = torch.stack([p.grad.norm() for p in plain.parameters()]).norm()
    max_norm = 2.0 * float(ref_norm)  # the gradients are well under the limit: nothing to clip
    balance = solve_balance([1.0] * len(model), workers)
    pipe = DistributedPipe(model_fn(4), balance, chunks=2, seed=INIT, timeout=scaled(20))
    x, y = shards[pipe.replica]
    torch.manual_seed(SEED)
    pipe.train_step(x, y, nn.functional.cross_entropy)
    before = {name: local_tensor(p.grad).clone() for name, p in pipe.named_parameters()}
    norm = clip_grad_norm_(pipe, max_norm)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
    for name, p in pipe.named_parameters():
        assert torch.equal(local_tensor(p.grad), before[name]), f"{name} changed under the limit"
    return {"norm": float(norm), "untouched": len(before)}


# ---- sequences of changing length: int tokens in, bool padding mask and a float carried -----


class TokenEmbed(nn.Module):
    """(tokens, pad) -> (hidden, pad, scale): a bool mask and a plain float cross boundaries."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, ...]:
        tokens, pad = batch
        return self.emb(tokens), pad, 0.5


class SeqBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, batch: tuple[Any, ...]) -> tuple[Any, ...]:
        h, pad, scale = batch
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return h + scale * self.drop(torch.tanh(self.fc(h))) * keep, pad, scale


class SeqHead(nn.Module):
    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, vocab)

    def forward(self, batch: tuple[Any, ...]) -> torch.Tensor:
        return self.fc(batch[0])


def seq_model(vocab: int = 11, d: int = 8, blocks: int = 2) -> nn.Sequential:
    return nn.Sequential(
        TokenEmbed(vocab, d), *[SeqBlock(d) for _ in range(blocks)], SeqHead(d, vocab)
    )


def seq_batch(n: int, t: int, vocab: int = 11, seed: int = 0) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, t), generator=g)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    pad = torch.arange(t).unsqueeze(0) >= lengths.unsqueeze(1)
    labels = torch.randint(0, vocab, (n, t), generator=g).masked_fill(pad, -100)
    return (tokens, pad), labels


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def count_tokens(labels: torch.Tensor) -> float:
    return float((labels != -100).sum())


def shapes(tmp: Path, workers: int) -> dict[str, Any]:
    """Sequence lengths and batch sizes change every step; tuples, masks, a float cross."""
    model = seq_model()
    init_layers(model, INIT)
    balance = solve_balance([1.0] * len(model), workers)
    pipe = DistributedPipe(seq_model, balance, chunks=2, seed=INIT, timeout=scaled(20))
    for step, (n, t) in enumerate([(6, 5), (8, 9), (5, 3)]):
        inputs, labels = seq_batch(n, t, seed=step)
        plain, ref_loss = reference(
            model, [(inputs, labels)], 2, step_seed(SEED + step), token_loss, count_tokens
        )
        pipe.zero_grad(set_to_none=True)
        torch.manual_seed(SEED + step)
        loss = pipe.train_step(
            inputs if pipe.needs_inputs else None,
            labels if pipe.needs_targets else None,
            token_loss,
            loss_normalizer=count_tokens,
        )
        assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (step, loss, ref_loss)
        assert_matches(pipe, plain, f"step {step} (n={n}, t={t})")
    # evaluation: the pipelined forward equals the plain model in eval mode
    pipe.eval()
    model.eval()
    inputs, labels = seq_batch(7, 4, seed=9)
    out = pipe(inputs if pipe.needs_inputs else None)
    with torch.no_grad():
        expected = model(inputs)
        expected_loss = token_loss(expected, labels) / count_tokens(labels)
    if pipe.needs_targets:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    else:
        assert out is None
    loss = pipe.eval_step(inputs, labels, token_loss, loss_normalizer=count_tokens)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    # this rank's shard: un-partitioned names, the plain model's values
    state = pipe.state_dict()
    full = model.state_dict()
    assert state and set(state) <= set(full)
    for name, value in state.items():
        torch.testing.assert_close(value, full[name], msg=name)
    return {"names": sorted(state)}


# ---- faults ----------------------------------------------------------------------------------


def toy_data(step: int, n: int = 16) -> tuple[Any, torch.Tensor]:
    return tuple_batch(n=n) if step == 0 else _shifted(tuple_batch(n=n), step)


def _shifted(batch: tuple[Any, torch.Tensor], step: int) -> tuple[Any, torch.Tensor]:
    (x, mask), y = batch
    return (x + 0.1 * step, mask), y


def faulty(
    tmp: Path,
    workers: int,
    fail_rank: int,
    how: str,
    trigger_call: int = 3,
    steps: int = 4,
    timeout: float = 5.0,
) -> dict[str, Any]:
    """Trains with a checkpoint after step 0; ``fail_rank`` raises or is SIGKILLed mid-step.

    Every surviving rank returns the failure message it raised and how long after the trigger
    (a file the failing rank writes just before failing) it stopped.
    """
    import os
    import signal
    import time

    from giantpipe.engine.distributed.faults import RankFailure

    rank = dist.get_rank()
    model = plain_model(2)
    balance = solve_balance([1.0] * len(model), workers)
    pipe = DistributedPipe(model_fn(2), balance, chunks=4, seed=INIT, timeout=timeout)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)

    def step(i: int) -> None:
        x, y = toy_data(i)
        pipe.train_step(x, y, nn.functional.cross_entropy)
        opt.step()
        opt.zero_grad()

    step(0)
    pipe.save_checkpoint(tmp / "ckpt", step=1)
    # whole tensors (FSDP2 shards gathered, by every replica in the same order)
    whole = {k: whole_tensor(v.detach()) for k, v in pipe.state_dict().items()}
    torch.save(whole, tmp / f"expected-{rank}.pt")
    trigger = tmp / "trigger"
    if rank == fail_rank:
        calls = [0]

        def hook(module: nn.Module, args: Any) -> None:
            calls[0] += 1
            if calls[0] == trigger_call:
                trigger.write_text(str(time.time()))
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if how == "hang":  # alive but silent: the neighbours' timeout must fire
                    time.sleep(3600)
                raise ValueError("injected failure")

        next(iter(pipe.children())).register_forward_pre_hook(hook)
    try:
        for i in range(1, steps):
            step(i)
    except RankFailure as exc:
        stopped = time.time()
        started = float(trigger.read_text()) if trigger.exists() else stopped
        # a killed or silent rank never reads the board: rank 0 waits for the others only
        readers = dist.get_world_size() - (0 if how == "raise" else 1)
        _outlive_the_others(rank, readers - 1)
        return {"failure": str(exc), "after_s": stopped - started}
    return {"failure": None}


def _outlive_the_others(rank: int, others: int, patience: float = 10.0) -> None:
    """The failure board lives in the world's store, which rank 0's process hosts in these
    launches (torchrun's agent does under torchrun): rank 0 stays until ``others`` ranks have
    read the board (a rank woken late, its peer torn down, would find no store)."""
    import time

    store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the board's store
    try:
        done = store.add("tests/read_the_board", 1)
        deadline = time.monotonic() + patience
        while rank == 0 and done < others + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            done = store.add("tests/read_the_board", 0)
    except Exception:  # noqa: BLE001, S110 - the store went with rank 0: nothing to wait for
        pass


def several(tmp: Path, calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Runs several of these checks in one launch (process start-up is the expensive part)."""
    results = {}
    for name, kwargs in calls:
        sub = tmp / name
        sub.mkdir(exist_ok=True)
        results[name] = globals()[name](sub, **kwargs)
    return results


# ---- checkpoints -----------------------------------------------------------------------------


def train_and_save(tmp: Path, workers: int, ckpt: str, steps: int = 2) -> dict[str, Any]:
    """``steps`` SGD steps on K=``workers``, then a sharded checkpoint; returns the local state."""
    model = plain_model(2)
    balance = solve_balance([1.0] * len(model), workers)
    pipe = DistributedPipe(model_fn(2), balance, chunks=2, seed=INIT, timeout=scaled(20))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for i in range(steps):
        x, y = toy_data(i)
        torch.manual_seed(SEED + i)
        pipe.train_step(x, y, nn.functional.cross_entropy)
        opt.step()
        opt.zero_grad()
    pipe.save_checkpoint(ckpt, step=steps, extra={"note": "k2"})
    return {"state": pipe.state_dict()}


def resume_and_step(tmp: Path, workers: int, ckpt: str, step: int = 2) -> dict[str, Any]:
    """Loads the shards into another K (parameters never initialised), takes one step and
    compares it with the plain model loaded from the same shards."""
    from giantpipe.checkpoint.load import load

    model = plain_model(2)
    model.load_state_dict(load(ckpt))
    balance = solve_balance([1.0] * len(model), workers)
    pipe = DistributedPipe(model_fn(2), balance, chunks=3, seed=INIT, init=None, timeout=scaled(20))
    manifest = pipe.load_checkpoint(ckpt)
    loaded = {k: v.clone() for k, v in pipe.state_dict().items()}
    x, y = toy_data(step)
    plain, ref_loss = reference(model, [(x, y)], 3, step_seed(SEED + step))
    torch.manual_seed(SEED + step)
    loss = pipe.train_step(x, y, nn.functional.cross_entropy)
    assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    n = assert_matches(pipe, plain, f"resumed on K={workers}")
    return {"loaded": loaded, "checked": n, "manifest_workers": manifest["workers"]}
