"""A run's state in its checkpoints: name-keyed optimizer state, resuming under another
balance, saving in the background (trainer.async_save), resuming from the earlier format."""

import errno
import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from giantpipe.checkpoint import save
from giantpipe.checkpoint.earlier import SHARDS_V1
from giantpipe.checkpoint.manifest import FORMAT
from giantpipe.checkpoint.run import RUN_FORMAT, read_checkpoint
from giantpipe.config import ConfigError
from giantpipe.engine import GPipe
from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from giantpipe.runner.build import build_experiment, parameter_names
from giantpipe.runner.loop import CheckpointWriteError
from giantpipe.runner.run_state import staging
from giantpipe.runner.run_state.restore import restore
from giantpipe.runner.run_state.state import (
    Progress,
    check_model_fits,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
)
from giantpipe.runner.run_state.writer import CheckpointWriter
from giantpipe.runner.seeding import rng_state, seed_everything
from giantpipe.runner.world import World
from tests.support.runs import tiny


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def take_steps(pipe: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        optimizer.zero_grad()
        losses.append(float(pipe.train_step(x, y, nn.functional.cross_entropy)))
        optimizer.step()
    return losses


def test_optimizer_state_keyed_by_name_survives_reordering():
    net = model()
    names = dict(net.named_parameters())
    first = torch.optim.Adam(list(names.values()), lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    first.step()
    saved = optimizer_state_by_name(first, names)
    assert set(saved["state"]) == set(names)
    second = torch.optim.Adam(list(reversed(list(names.values()))), lr=0.1)
    load_optimizer_state_by_name(second, saved, names)
    for param in names.values():
        assert torch.equal(second.state[param]["exp_avg"], first.state[param]["exp_avg"])


def test_optimizer_of_another_kind_is_rejected():
    net = model()
    names = dict(net.named_parameters())
    saved = optimizer_state_by_name(torch.optim.SGD(names.values(), lr=0.1, momentum=0.9), names)
    with pytest.raises(ValueError, match="differ"):
        load_optimizer_state_by_name(torch.optim.AdamW(names.values()), saved, names)


def test_k2_checkpoint_resumes_under_k3_with_the_same_trajectory():
    # Reference: 4 steps with K=2.
    ref = GPipe(model(), [2, 3], devices=["cpu", "cpu"], chunks=2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    expected = take_steps(ref, ref_opt, 4)
    # 2 steps with K=2, save by name, continue 2 steps with K=3.
    a = GPipe(model(), [2, 3], devices=["cpu", "cpu"], chunks=2)
    a_opt = torch.optim.Adam(a.parameters(), lr=0.05)
    take_steps(a, a_opt, 2)
    names_a = parameter_names(a, a)
    state = {"model": a.state_dict(), "optimizer": optimizer_state_by_name(a_opt, names_a)}
    b_model = model()
    b = GPipe(b_model, [1, 2, 2], devices=["cpu", "cpu", "cpu"], chunks=2)
    b_opt = torch.optim.Adam(b.parameters(), lr=0.05)
    names_b = parameter_names(b, b_model)
    b.load_state_dict(state["model"])
    load_optimizer_state_by_name(b_opt, state["optimizer"], names_b)
    resumed = []
    for i in range(2, 4):
        torch.manual_seed(100 + i)
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        b_opt.zero_grad()
        resumed.append(float(b.train_step(x, y, nn.functional.cross_entropy)))
        b_opt.step()
    assert resumed == pytest.approx(expected[2:], rel=1e-5)


def test_parameter_names_are_the_unpartitioned_names():
    net = model()
    pipe = GPipe(net, [3, 2], devices=["cpu", "cpu"])
    assert set(parameter_names(pipe, net)) == {
        f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")
    }


def test_model_that_does_not_fit_is_one_line_naming_the_path(tmp_path: Path):
    live = {"0.weight": torch.zeros(2, 2)}
    with pytest.raises(ConfigError, match=r"trainer.resume: .*x.pt does not fit .*0.weight"):
        check_model_fits({"0.weight": torch.zeros(3, 2)}, live, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="missing"):
        check_model_fits({}, live, tmp_path / "x.pt")


# -- trainer.async_save: the step waits for the copy, not for the write ------------------------


def stepped(cfg):
    """A built run of ``cfg`` after one optimizer step (so the optimizer holds state)."""
    seed_everything(0)
    parts = build_experiment(cfg)
    x, y = next(parts.bundle.train_batches(0, 0))
    parts.pipe.train_step(x, y, parts.loss_fn)
    parts.optimizer.step()
    return parts


def test_an_async_save_returns_before_the_write_and_saves_the_state_it_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = stepped(tiny(eval_every=0))
    held, started = threading.Event(), threading.Event()
    real = staging.save_collective

    def held_write(*args, **kwargs):
        started.set()
        assert held.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(staging, "save_collective", held_write)
    writer = CheckpointWriter(World(), asynchronous=True)
    before = {k: v.clone() for k, v in parts.pipe.state_dict().items()}
    writer.save(parts, Progress(step=1, position=1), tmp_path / "last")  # the write is held
    assert started.wait(60) and not (tmp_path / "last" / "manifest.json").exists()
    with torch.no_grad():  # the next step changes the weights while the write waits
        for param in parts.names.values():
            param.add_(1.0)
    held.set()
    writer.wait()
    saved = read_checkpoint(tmp_path / "last")
    assert saved["step"] == 1 and saved["model"].keys() == before.keys()
    assert all(torch.equal(saved["model"][k], v) for k, v in before.items())


def test_async_saves_resume_exactly_as_synchronous_ones(tmp_path: Path) -> None:
    cfg = tiny(max_steps=6, eval_every=0, checkpoint_every=3, log_every=1)
    train(cfg, tmp_path / "sync", "")
    train(replace(cfg, trainer=replace(cfg.trainer, async_save=True)), tmp_path / "async", "")
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    for name in ("step_3", "last"):
        a, b = (read_checkpoint(tmp_path / run / name)["model"] for run in ("sync", "async"))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    resumed = replace(cfg.trainer, resume=str(tmp_path / "async" / "step_3"))
    train(replace(cfg, trainer=resumed), tmp_path / "resumed", "")
    assert losses(tmp_path / "resumed") == losses(tmp_path / "sync")[3:]


def test_a_failed_background_write_is_reported_never_lost(tmp_path, monkeypatch) -> None:
    writes = {"n": 0}
    real = save.write_folder

    def full_disk(folder, *args, **kwargs):
        writes["n"] += 1
        if writes["n"] == 3:  # step_2 and last at step 2 commit; step_4 hits a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "__0_0.distcp"))
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(save, "write_folder", full_disk)  # what a save calls
    cfg = tiny(max_steps=4, eval_every=0, checkpoint_every=2, async_save=True)
    with pytest.raises(CheckpointWriteError) as info:  # raised at the end of the run
        train(cfg, tmp_path, "")
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message
    assert "cannot save the checkpoint of step 4" in message and "step_4/step000000004" in message
    assert f"last good checkpoint: {tmp_path / 'last'} (step 2)" in message
    assert read_checkpoint(tmp_path / "last")["step"] == 2
    assert not (tmp_path / "step_4" / "manifest.json").exists()


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


# -- the earlier format ------------------------------------------------------------------------


def write_earlier_format(directory: Path, parts, progress: Progress) -> None:
    """A local run's checkpoint as giantpipe wrote it before DCP (giantpipe-shards/1): the
    weights in one .pt shard, the run state (optimizer tensors included) in another."""
    directory.mkdir(parents=True)
    token = "step000000002-3f9c2a"
    weights = {k: v.detach().clone() for k, v in parts.pipe.state_dict().items()}
    torch.save(weights, directory / f"{token}-rank00000.pt")
    state = {
        "rank": 0,
        "step": progress.step,
        "position": progress.position,
        "scheduler": parts.scheduler.state_dict(),
        "rng": rng_state(),
        "optimizer": optimizer_state_by_name(parts.optimizer, parts.names),
        "ema": None,
        "grad_scaler": None,
    }
    torch.save(state, directory / f"state-{token}-rank00000.pt")
    shard = {"file": f"{token}-rank00000.pt", "rank": 0, "stages": [0, 1], "names": list(weights)}
    extra = {"format": RUN_FORMAT, "step": progress.step, "position": progress.position}
    extra.update(state_files=[f"state-{token}-rank00000.pt"], leader_ranks=[0], ema=False)
    manifest = {
        "format": SHARDS_V1,
        "step": progress.step,
        "balance": list(parts.spec.balance),
    }
    manifest.update(workers=2, replicas=1, placement=[0, 1], shards=[shard], extra=extra)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def write_one_file(run_dir: Path, parts, progress: Progress) -> None:
    """A local run's checkpoint as giantpipe wrote it first: everything in one last.pt."""
    run_dir.mkdir(parents=True)
    state = {
        "format_version": 1,
        "step": progress.step,
        "position": progress.position,
        "balance": list(parts.spec.balance),
        "model": {k: v.detach().clone() for k, v in parts.pipe.state_dict().items()},
        "optimizer": optimizer_state_by_name(parts.optimizer, parts.names),
        "scheduler": parts.scheduler.state_dict(),
        "ema": None,
        "rng": rng_state(),
    }
    torch.save(state, run_dir / "last.pt")


@pytest.fixture(scope="module")
def halfway(tmp_path_factory: pytest.TempPathFactory):
    """A 4-step run's losses, and the same run's state after 2 steps."""
    tmp = tmp_path_factory.mktemp("earlier")
    cfg = tiny(max_steps=4, eval_every=0, log_every=1)
    train(cfg, tmp / "full", "")
    train(replace(cfg, trainer=replace(cfg.trainer, max_steps=2)), tmp / "half", "")
    return cfg, losses(tmp / "full"), tmp / "half"


@pytest.mark.parametrize("earlier", ["giantpipe-shards/1", "last.pt"])
def test_a_checkpoint_of_an_earlier_format_resumes_exactly_and_is_saved_anew(
    earlier: str, halfway, tmp_path: Path
) -> None:
    cfg, full, half = halfway
    parts = build_experiment(cfg)
    progress = restore(parts, half / "last", World())
    old = tmp_path / "old"
    if earlier == "last.pt":
        write_one_file(old, parts, progress)
    else:
        write_earlier_format(old / "last", parts, progress)
    (old / "metrics.jsonl").write_bytes((half / "metrics.jsonl").read_bytes())
    train(replace(cfg, trainer=replace(cfg.trainer, resume=True)), old, "")
    assert losses(old) == full
    manifest = json.loads((old / "last" / "manifest.json").read_text())
    assert manifest["format"] == FORMAT and manifest["step"] == 4
    assert sorted(p.name for p in (old / "last").iterdir()) == ["manifest.json", manifest["folder"]]
