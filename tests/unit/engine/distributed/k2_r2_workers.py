"""What each rank of tests/unit/engine/distributed/test_k2_r2.py runs: K=2 pipeline ranks x R=2
replicas on gloo, checked through the public API against the plain model.

One :class:`DistributedPipe` (1F1B, M=4: sends and receives interleave; its transfers in
NCCL's order, on gloo), a small MLP with dropout; each rank returns what it saw,
the test compares across ranks:

1. the warm-up: the calls the pipe made while it was built are what the rank must warm up,
   derived from where it sits (:func:`must_warm`; the tied pipe of 7 too); the test replays
   every rank's calls under NCCL's rule;
2. two engine steps without ``zero_grad``: the loss of each and the accumulated gradients equal
   the plain model's over the whole batch (both replicas' shards);
3. ``pipe.clip_grad_norm_``: the global norm and the clipped gradients, as
   ``torch.nn.utils.clip_grad_norm_`` on the plain model;
4. resume with RNG: the runner's save (every rank's generators), a step, the generators
   scrambled differently on each rank, the runner's restore on every rank, the same step: its
   dropout (loss and gradients) equals the plain model's both times;
5. fp16-style overflow on one rank: an inf planted in rank 3's gradients after a step with the
   pipe's ``grad_scaler``: every rank skips the step and halves the scale; a clean step after
   moves every rank;
6. the transport's sends and receives of bytes in step 1 (the inputs' layout of step 0: bytes
   alone, no description on the host), recorded: exactly the order ``message_order.worker_ops``
   gives (the test replays every rank's under NCCL's rule);
7. a second pipe, of a model whose input and output layers share a weight (held by both
   pipeline ranks) and whose boundary value is not contiguous: two steps' losses and
   accumulated gradients, the global-norm clip and the clipped gradients equal the plain
   model's (the tied weight keeps the first step's gradient and is counted once in the norm,
   the boundary value received with its values);
8. a pipe whose replicas each hold their whole stage (``replica_sharding="none"``): a step's
   gradients, the global-norm clip and the clipped gradients equal the plain model's (each
   replicated gradient counted once, not once per replica);
9. K=4 over the world, the transport on its device path (on GPUs a receive only makes the
   stream wait, its request asked after the step): rank 2's first receive is aborted after
   its stream wait, as NCCL's watchdog may; the step raises on every rank, none returns a loss.
10. building by share, a deeper model from meta: the shards hold the plain model's initial
    weights, and no rank holds more than its share and one layer (:mod:`.share_workers`);
11. ``replica_sharding="full"`` (ZeRO-3), two layers with parameters per stage: two steps'
    accumulated gradients equal the plain model's, and whenever a gradient lands on a
    gathered parameter the rank holds at most one unit (layer) of unsharded gradients and of
    gathered parameters: each micro-batch's gradients are reduce-scattered as its backward of
    a unit ends, not accumulated whole over the step (:class:`UnshardedWatch`).

Gradients and weights are read as whole tensors (``full_tensor`` of a sharded parameter) or as
this rank's shard (``to_local``), so the checks hold however the replicas hold a stage.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from giantpipe.engine.distributed.faults import RankFailure
from giantpipe.engine.distributed.layout import WARM_UP, Layout
from giantpipe.engine.distributed.message_order import worker_ops
from giantpipe.engine.distributed.p2p import DESCRIPTIONS, PAYLOADS
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.mailbox import Mailbox
from giantpipe.engine.meta import init_layers
from giantpipe.runner.build import parameter_names
from giantpipe.runner.run_state.restore import restore
from giantpipe.runner.run_state.staging import save_run
from giantpipe.runner.run_state.state import Progress
from giantpipe.runner.world import TorchrunWorld
from giantpipe.testing import step_seed
from tests.support.recording import recording
from tests.support.shards import reference, shard
from tests.timeouts import scaled
from tests.unit.engine.distributed.share_workers import check_share

SEED, INIT, CHUNKS, MAX_NORM, BAD_RANK = 5, 3, 4, 0.05, 3
LOSS = nn.functional.cross_entropy


def model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16), nn.Dropout(0.25), nn.ReLU(),
        nn.Linear(16, 16), nn.Dropout(0.25), nn.Linear(16, 4),
    )  # fmt: skip


class Embed(nn.Module):
    """Features to hidden through ``proj``, whose weight the head reuses."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class ColumnMajor(nn.Module):
    """Its input laid out column by column: the same values in a tensor that is not
    contiguous (as a transposed attention output is)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous().t()


class TiedHead(nn.Module):
    """Hidden to 8 logits with the embedding's weight (no ``reset_parameters``: the first
    stage's rank gives the value)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight


def tied_model() -> nn.Sequential:
    """Cut [3, 3]: the tied weight on both pipeline ranks, ColumnMajor's output at the cut."""
    embed = Embed()
    return nn.Sequential(
        embed, nn.Tanh(), ColumnMajor(), nn.Linear(16, 16), nn.Tanh(), TiedHead(embed.proj.weight)
    )


def shards(step: int, replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each replica's share of step ``step``'s batch of 16."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    return [(shard(x, r, replicas), shard(y, r, replicas)) for r in range(replicas)]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a sharded one: every replica of the stage calls it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def step(pipe: DistributedPipe, number: int, scaler: Any = None) -> float:
    x, y = shards(number, pipe.replicas)[pipe.replica]
    loss = pipe.train_step(
        x if pipe.needs_inputs else None,
        y if pipe.needs_targets else None,
        LOSS,
        grad_scaler=scaler,
    )
    return float(loss)


def grads_equal(pipe: DistributedPipe, plain: nn.Module, what: str) -> int:
    """This rank's gradients equal the plain model's, by name; returns how many."""
    want = dict(plain.named_parameters(remove_duplicate=False))  # a tied weight: both names
    names = list(pipe.named_parameters())
    for name, p in names:
        assert p.grad is not None, f"{what}: {name} has no gradient"
        got, expected = full(p.grad), want[name].grad
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=f"{what}: {name}")
    return len(names)


def warm_up_calls(log: list[dict[str, Any]]) -> list[tuple[str, Any, str]]:
    """The recorded warm-up of a pipe being built: each device collective (``all_reduce``, its
    group's ranks) and message (its call, the peer), with its communicator."""
    return [
        (e["call"], tuple(e["group"]) if e["call"] == "all_reduce" else e["peer"], e["comm"])
        for e in log
        if e["call"] == "all_reduce" or (e["call"] in ("isend", "irecv") and e["tag"] == WARM_UP)
    ]


def must_warm(rank: int, tied: bool) -> list[tuple[str, Any]]:
    """What ``rank`` of this world (K=2 x R=2, stage s of replica q on rank 2q + s) must warm
    up, from where it sits: the world's group, its replica's pipeline, its stage's replicas, the
    tied weight's group (both stages of its replica hold it), then its neighbour's message (the
    first stage sends)."""
    replica, stage = divmod(rank, 2)
    pipeline = (2 * replica, 2 * replica + 1)
    want: list[tuple[str, Any]] = [("all_reduce", (0, 1, 2, 3)), ("all_reduce", pipeline)]
    want.append(("all_reduce", (stage, stage + 2)))
    if tied:
        want.append(("all_reduce", pipeline))
    want.append(("isend", rank + 1) if stage == 0 else ("irecv", rank - 1))
    return want


def payload_ops(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded sends and receives of bytes (the transport's device operations)."""
    kinds = {"isend": "send", "irecv": "recv"}
    return [
        {"kind": kinds[e["call"]], "peer": e["peer"], "nbytes": e["nbytes"]}
        for e in log
        if e["call"] in kinds and e["tag"] == PAYLOADS
    ]


def check(tmp: Path) -> dict[str, Any]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    built: list[dict[str, Any]] = []
    with recording(built):
        pipe = DistributedPipe(
            model, [3, 3], chunks=CHUNKS, schedule="1f1b", seed=INIT, timeout=scaled(20)
        )
    layout = Layout(world_size, rank, 2, tuple(pipe.placement))
    warmed = warm_up_calls(built)
    assert [c[:2] for c in warmed] == must_warm(rank, tied=False), warmed

    plain = model()
    init_layers(plain, INIT)
    out: dict[str, Any] = {"rank": rank, "warmed": [warmed]}

    # 2. two engine steps, gradients accumulated; step 1's payloads recorded
    losses, log = [], []
    for number in (0, 1):
        torch.manual_seed(SEED + number)
        with recording(log if number == 1 else []):
            losses.append(step(pipe, number))
        seed = step_seed(SEED + number)
        _, ref = reference(plain, shards(number, 2), CHUNKS, seed, accumulate=True)
        assert abs(losses[-1] - ref) <= 1e-5 * abs(ref), (number, losses[-1], ref)
    out["checked"] = grads_equal(pipe, plain, "two accumulated steps")
    out["payloads"] = payload_ops(log)
    out["described"] = [e["call"] for e in log if e["tag"] == DESCRIPTIONS and "send" in e["call"]]
    steps = pipe.step_schedule()
    actions = tuple(map(tuple, steps.actions))
    want = [
        (op.kind, layout.replica * 2 + op.peer)
        for op in worker_ops(actions, tuple(steps.placement), layout.worker)
    ]
    assert [(o["kind"], o["peer"]) for o in out["payloads"]] == want, (out["payloads"], want)

    # 3. the global-norm clip
    clip_equal(pipe, plain)
    grads_equal(pipe, plain, "clipped")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt.step()
    plain_opt.step()
    opt.zero_grad()
    plain_opt.zero_grad()

    # 4. resume with RNG: save, a step, every rank's generators scrambled, restore, the step
    world = TorchrunWorld(timeout=scaled(20.0))
    world.bind(pipe)
    parts = SimpleNamespace(
        pipe=pipe,
        names=parameter_names(pipe),
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
        ema=None,
        grad_scaler=None,
    )
    torch.manual_seed(SEED + 2)  # every rank: the generators the save keeps
    save_run(parts, Progress(step=2, position=0), tmp / "ckpt", world)  # type: ignore[arg-type]
    after_save = copy.deepcopy(plain)
    _, ref = reference(after_save, shards(2, 2), CHUNKS, step_seed(SEED + 2), accumulate=True)
    torch.manual_seed(SEED + 2)  # reference's step_seed drew from this process's generator
    resumed = []
    for attempt in ("after the save", "after the restore"):
        if attempt == "after the restore":
            torch.manual_seed(1000 + rank)  # what ran since: other draws on every rank
            restore(parts, tmp / "ckpt", world)  # type: ignore[arg-type]
        resumed.append(step(pipe, 2))
        assert abs(resumed[-1] - ref) <= 1e-5 * abs(ref), (attempt, resumed[-1], ref)
        grads_equal(pipe, after_save, attempt)
        opt.zero_grad()
    out["resumed"] = resumed

    # 5. an overflow on one rank: every rank skips, the scale halves everywhere
    scaler = pipe.grad_scaler(init_scale=2.0**10, growth_interval=1000)
    moved, scales = [], []
    for number, overflow in ((3, True), (4, False)):
        torch.manual_seed(SEED + number)
        step(pipe, number, scaler)
        if overflow and rank == BAD_RANK:  # as if only this rank's stage overflowed
            local(next(iter(pipe.parameters())).grad).view(-1)[0] = float("inf")
        before = [local(p).detach().clone() for p in pipe.parameters()]
        scaler.step(opt)
        scaler.update()
        now = [local(p).detach() for p in pipe.parameters()]
        moved.append(not all(torch.equal(a, b) for a, b in zip(now, before, strict=True)))
        scales.append(float(scaler.get_scale()))
        opt.zero_grad()
    out["moved"], out["scales"], out["losses"] = moved, scales, losses
    pipe.release()
    out["tied_norm"], tied_warmed = tied_and_strided()
    out["warmed"].append(tied_warmed)
    out["replicated_norm"] = replicated_clip()
    out["share"] = check_share()  # 10. building by share (share_workers.py)
    out["zero3"] = zero3_holds_one_unit()
    out["failed_step"] = failed_transfer()  # last: the failure tears the pipe's groups down
    return out


def tied_and_strided() -> tuple[float, list[tuple[str, Any, str]]]:
    """7. two steps without ``zero_grad``, then the clip, of a pipe of :func:`tied_model`;
    returns the norm and the pipe's warm-up calls."""
    plain = tied_model()
    init_layers(plain, INIT)
    boundary = plain[:3](shards(5, 2)[0][0][:2])  # one micro-batch's value at the cut
    assert not boundary.is_contiguous(), "the model should send a value that is not contiguous"
    built: list[dict[str, Any]] = []
    with recording(built):
        pipe = DistributedPipe(tied_model, [3, 3], chunks=CHUNKS, seed=INIT, timeout=20)
    warmed = warm_up_calls(built)
    assert [c[:2] for c in warmed] == must_warm(dist.get_rank(), tied=True), warmed
    for number in (5, 6):  # accumulated: the tied weight keeps step 5's gradient through 6's
        torch.manual_seed(SEED + number)
        loss = step(pipe, number)
        seed = step_seed(SEED + number)
        _, ref = reference(plain, shards(number, 2), CHUNKS, seed, accumulate=True)
        assert abs(loss - ref) <= 1e-5 * abs(ref), ("tied, strided", number, loss, ref)
    grads_equal(pipe, plain, "tied, strided, two accumulated steps")
    norm = clip_equal(pipe, plain)
    assert float(norm) > MAX_NORM  # so the clip scaled every gradient
    grads_equal(pipe, plain, "tied, strided, clipped")
    pipe.release()
    return float(norm), warmed


def clip_equal(pipe: DistributedPipe, plain: torch.nn.Module) -> float:
    """The pipe's global-norm clip and the plain model's: the same norm."""
    norm = pipe.clip_grad_norm_(MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
    torch.testing.assert_close(float(norm), float(ref_norm), rtol=1e-5, atol=0.0)
    return float(norm)


def replicated_clip() -> float:
    """8. a step of a pipe whose replicas each hold their whole stage, then the clip; returns
    the norm."""
    plain = model()
    init_layers(plain, INIT)
    pipe = DistributedPipe(
        model, [3, 3], chunks=CHUNKS, seed=INIT, timeout=20, replica_sharding="none"
    )
    torch.manual_seed(SEED + 7)
    loss = step(pipe, 7)
    _, ref = reference(plain, shards(7, 2), CHUNKS, step_seed(SEED + 7), accumulate=True)
    assert abs(loss - ref) <= 1e-5 * abs(ref), ("replicated", loss, ref)
    grads_equal(pipe, plain, "replicated")
    norm = clip_equal(pipe, plain)
    assert float(norm) > MAX_NORM  # so the clip scaled every gradient
    grads_equal(pipe, plain, "replicated, clipped")
    pipe.release()
    return float(norm)


def two_units_a_stage() -> nn.Sequential:
    """Cut [4, 3]: two layers with parameters in each stage (so two FSDP2 units with ``full``)."""
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4),
    )  # fmt: skip


class UnshardedWatch:
    """Whenever a gradient lands on a gathered (unsharded) parameter of ``layers``: the bytes
    of unsharded gradients still alive (whoever holds them: ``.grad``, FSDP2's accumulation, a
    reduce's input list), and of gathered parameters whose storage is allocated; the largest
    of each. No allocator statistics on the CPU: the landings are when these bytes grow."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.gathered: dict[int, torch.Tensor] = {}  # the unsharded parameters, by id
        self.grads: dict[int, weakref.ref[torch.Tensor]] = {}
        self.landings = self.peak_grads = self.peak_params = 0
        self.handles: list[Any] = [layer.register_forward_pre_hook(self._seen) for layer in layers]

    def _seen(self, layer: nn.Module, args: Any) -> None:
        # After FSDP2's own pre-hook (prepended): the layer holds its gathered parameters.
        for p in layer.parameters():
            if not isinstance(p, DTensor) and id(p) not in self.gathered:
                self.gathered[id(p)] = p
                self.handles.append(p.register_post_accumulate_grad_hook(self._landed))

    def _landed(self, p: torch.Tensor) -> None:
        assert p.grad is not None
        self.landings += 1
        self.grads[id(p.grad)] = weakref.ref(p.grad)
        alive = [g for g in (ref() for ref in self.grads.values()) if g is not None]
        self.peak_grads = max(self.peak_grads, sum(g.nbytes for g in alive))
        whole = [q for q in self.gathered.values() if q.untyped_storage().nbytes() > 0]
        self.peak_params = max(self.peak_params, sum(q.nbytes for q in whole))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def zero3_holds_one_unit() -> dict[str, int]:
    """11. two steps of a ``full`` pipe without ``zero_grad``, watched; returns the largest
    unit's bytes, the stage's and what the watch saw."""
    plain = two_units_a_stage()
    init_layers(plain, INIT)
    pipe = DistributedPipe(
        two_units_a_stage, [4, 3], chunks=CHUNKS, seed=INIT, timeout=20, replica_sharding="full"
    )
    assert pipe.shards is not None
    units = [cast(nn.Module, u) for u in pipe.shards.units]
    unit_bytes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in units]
    watch = UnshardedWatch(units)
    for number in (9, 10):  # accumulated: each micro-batch's shard adds to the steps' before
        torch.manual_seed(SEED + number)
        loss = step(pipe, number)
        seed = step_seed(SEED + number)
        _, ref = reference(plain, shards(number, 2), CHUNKS, seed, accumulate=True)
        assert abs(loss - ref) <= 1e-5 * abs(ref), ("full", number, loss, ref)
    watch.remove()
    grads_equal(pipe, plain, "full, reduced each micro-batch, two accumulated steps")
    pipe.release()
    return {
        "unit": max(unit_bytes),
        "stage": sum(unit_bytes),
        "landings": watch.landings,
        "grads": watch.peak_grads,
        "params": watch.peak_params,
    }


ABORTED_RANK = 2


class LikeNccl:
    """A gloo receive answering as an NCCL request does: a wait without a timeout (the
    consumer's stream's) waits for the bytes; after it, a wait with one answers at once (a gloo
    request is waited on once), False if NCCL's watchdog aborted it meanwhile: the first
    stream-waited one while ``aborting`` holds an item. The host, ahead of the device, never
    finds an aborted one complete."""

    def __init__(self, work: Any, aborting: list[bool]) -> None:
        self.work, self.aborting, self.streamed, self.aborted = work, aborting, False, False

    def wait(self, timeout: Any = None) -> bool:
        if timeout is None:
            done, self.streamed = bool(self.work.wait()), True
            if self.aborting:
                self.aborted = self.aborting.pop()
            return done
        return not self.aborted if self.streamed else bool(self.work.wait(timeout))

    def is_completed(self) -> bool:
        return not self.aborted and bool(self.work.is_completed())


@contextlib.contextmanager
def device_path(aborting: list[bool]) -> Iterator[None]:
    """The transport on its device path on gloo, as on GPUs (every mailbox class that asks
    ``_on_device``), its receives answering :class:`LikeNccl`."""
    classes, todo = [], list(Mailbox.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "_on_device" in vars(cls):
            classes.append(cls)
    assert classes, "no mailbox takes a device path: point this check at the transport's"
    real_irecv = dist.irecv

    def irecv(*args: Any, **kwargs: Any) -> Any:
        return LikeNccl(real_irecv(*args, **kwargs), aborting)

    with pytest.MonkeyPatch.context() as patch:
        for cls in classes:
            patch.setattr(cls, "_on_device", lambda self: True)
        patch.setattr(dist, "irecv", irecv)
        yield


def failed_transfer() -> dict[str, Any]:
    """9. a step whose first device receive on rank 2 was aborted after its stream wait;
    returns whether this rank's was, and what the step raised here (a loss returned fails)."""
    pipe = DistributedPipe(model, [2, 1, 2, 1], chunks=CHUNKS, seed=INIT, timeout=scaled(20))
    aborting = [True] if dist.get_rank() == ABORTED_RANK else []
    with device_path(aborting):
        try:
            loss = step(pipe, 8)
        except RankFailure as exc:
            return {"aborted": dist.get_rank() == ABORTED_RANK, "raised": str(exc)}
    raise AssertionError(f"a step with an aborted transfer returned a loss, {loss}")
