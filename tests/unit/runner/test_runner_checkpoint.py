"""Checkpoint IO: atomic writes, name-keyed optimizer state, resuming under another balance."""

from pathlib import Path

import pytest
import torch
from torch import nn

from giantpipe.config import ConfigError
from giantpipe.engine import GPipe
from giantpipe.runner.build import parameter_names
from giantpipe.runner.checkpoint import (
    atomic_save,
    check_model_fits,
    load_checkpoint,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
)


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("boom")


def test_atomic_save_replaces_whole_file_and_leaves_no_temp(tmp_path: Path):
    path = tmp_path / "last.pt"
    atomic_save({"step": 1}, path)
    atomic_save({"step": 2}, path)
    assert torch.load(path)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path):
    path = tmp_path / "last.pt"
    atomic_save({"step": 1}, path)
    with pytest.raises(RuntimeError, match="boom"):
        atomic_save({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


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


def test_unreadable_or_foreign_checkpoint_is_a_config_error(tmp_path: Path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="junk.pt is not a readable checkpoint"):
        load_checkpoint(junk)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": 1}, foreign)
    with pytest.raises(ConfigError, match="not a giantpipe checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(ConfigError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "absent.pt")
