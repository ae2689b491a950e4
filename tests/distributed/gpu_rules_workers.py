"""What each rank runs in tests/distributed/test_cuda_only_world.py: a whole training round of
the distributed pipe in a world whose default group serves CUDA tensors only.

``init_process_group("cuda:gloo")`` registers gloo for the ``cuda`` device alone, so any CPU
tensor handed to the world group (or to a group that inherits its backend) fails with "No
backend type associated with device type cpu", exactly as it would on an NCCL world. A pipe on
the CPU must then run entirely on groups that name their backend: device groups for its
tensors, host groups for its host numbers and objects. The checks compare with the plain model
(as tests/distributed/workers.py does): a model with deferred BatchNorm and a parameter tied
between the first and the last stage.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from giantpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.distributed.replicas import local_tensor
from giantpipe.engine.meta import init_layers
from giantpipe.runner.world import TorchrunWorld
from giantpipe.testing import step_seed
from tests.distributed.workers import INIT, SEED, mine, toy_data
from tests.support.shards import reference, shard
from tests.timeouts import scaled
from tests.unit.engine.engine_helpers import Block

D_IN, D = 6, 16


class TiedEmbed(nn.Module):
    """(features, mask) -> (hidden, mask) through ``proj``, whose weight the head reuses."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D_IN, D, bias=False)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, mask = batch
        return self.proj(x), mask


class TiedHead(nn.Module):
    """(hidden, mask) -> logits over D_IN classes with the embedding's weight, transposed.

    No ``reset_parameters``: the weight is the embedding's, initialised with layer 0 (the
    holder of the last stage gets its value from the first stage's rank, see TiedSync).
    """

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return batch[0] @ self.weight


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    embed = TiedEmbed()
    return nn.Sequential(embed, Block(D), Block(D), TiedHead(embed.proj.weight))


def _plain() -> nn.Sequential:
    model = convert_deferred_batch_norm(tied_model())
    init_layers(model, INIT)
    return model


def _check_grads(pipe: nn.Module, plain: nn.Module, what: str) -> int:
    """This rank's gradients and buffers equal the plain model's (a tied copy under either of
    its names); returns how many parameters were compared."""
    want = dict(plain.named_parameters(remove_duplicate=False))
    count = 0
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(  # this rank's shard with replicas (FSDP2)
            local_tensor(p.grad), mine(want[name].grad, p.grad), rtol=1e-4, atol=1e-5, msg=name
        )
        count += 1
    buffers = dict(plain.named_buffers())
    for name, b in pipe.named_buffers():
        torch.testing.assert_close(b, buffers[name], rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")
    return count


def _round_of_the_runner(world: TorchrunWorld, label: str) -> None:
    """Every collective of the runner's world: objects, sums, a barrier."""
    rank, size = dist.get_rank(), dist.get_world_size()
    assert world.from_rank0(f"{label} from {rank}") == f"{label} from 0"
    assert world.gather(rank) == list(range(size))
    collected = world.collect(rank)
    assert collected == (list(range(size)) if rank == 0 else None)
    assert world.sum([1.0, float(rank)]) == [float(size), float(sum(range(size)))]
    assert world.agree(lambda: label) == label
    world.barrier()


def train_round(tmp: Path, workers: int, chunks: int = 2, max_norm: float = 0.05) -> dict:
    """Two SGD steps (with clipping) of the pipe and of the plain model, a checkpoint saved and
    loaded back, then the runner's collectives before and after ``bind``: all on a world that
    refuses CPU tensors, all equal to the plain model."""
    replicas = dist.get_world_size() // workers
    plain = _plain()
    pipe = DistributedPipe(
        tied_model,
        [2, 2],
        chunks=chunks,
        deferred_batch_norm=True,
        seed=INIT,
        timeout=scaled(20),
        device="cpu",
    )
    assert pipe.tied.held, "the model's tied weight should span both pipeline ranks"
    pipe_opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses, norms = [], []
    for step in range(2):
        inputs, target = toy_data(step)
        shards = [(shard(inputs, r, replicas), shard(target, r, replicas)) for r in range(replicas)]
        _, ref_loss = reference(plain, shards, chunks, step_seed(SEED + step), accumulate=True)
        commit_deferred_batch_norm(plain)
        x, y = shards[pipe.replica]
        torch.manual_seed(SEED + step)
        loss = pipe.train_step(
            x if pipe.needs_inputs else None,
            y if pipe.needs_targets else None,
            nn.functional.cross_entropy,
        )
        torch.testing.assert_close(loss.item(), ref_loss, rtol=1e-5, atol=0.0)
        _check_grads(pipe, plain, f"step {step}")
        ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
        norm = pipe.clip_grad_norm_(max_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
        checked = _check_grads(pipe, plain, f"step {step}, clipped")
        pipe_opt.step()
        plain_opt.step()
        pipe_opt.zero_grad()
        plain_opt.zero_grad()
        losses.append(loss.item())
        norms.append(float(norm))
    saved = {k: local_tensor(v).clone() for k, v in pipe.state_dict().items()}
    pipe.save_checkpoint(tmp / "ckpt", step=2)
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    manifest = pipe.load_checkpoint(tmp / "ckpt")
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(local_tensor(value), saved[name], rtol=0, atol=0, msg=name)
    world = TorchrunWorld(timeout=scaled(20.0))  # its set-up collectives, as before a pipe exists
    _round_of_the_runner(world, "set-up")
    world.bind(pipe)
    _round_of_the_runner(world, "bound")
    pipe.release()
    return {"losses": losses, "norms": norms, "checked": checked, "step": manifest["step"]}
