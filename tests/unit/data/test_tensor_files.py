"""Issue 22, item 6: ``data=tensors`` loads ``train.pt`` / ``eval.pt`` as data only; a file that
would run code, or is no pair of tensors, is one line naming ``data.root`` and the file, worded
like resume's refusal (never torch's advice to load it with ``weights_only=False``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from giantpipe.config import ConfigError
from giantpipe.data.tensor_files import tensor_files


def write_split(root: Path, split: str, payload: object) -> Path:
    root.mkdir(exist_ok=True)
    torch.save(payload, root / f"{split}.pt")
    return root / f"{split}.pt"


def pair(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.randint(0, 2, (n,))


def refusal(root: Path) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        tensor_files(str(root), features=4, classes=2, batch_size=8)
    assert "\n" not in str(caught.value)
    return caught.value


def test_a_data_file_that_would_run_code_is_refused_without_running_it(tmp_path: Path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    root = tmp_path / "data"
    train = write_split(root, "train", (*pair(), Payload()))
    write_split(root, "eval", pair())
    error = refusal(root)
    assert error.key == "data.root"
    assert str(error).startswith(
        f"data.root: {train} holds posix.system, which a data file of tensors never needs; "
        "refused without running it"
    )
    assert "weights_only" not in str(error)
    assert not marker.exists()


def test_a_file_that_is_no_pair_of_tensors_or_no_torch_file_names_itself(tmp_path: Path):
    root = tmp_path / "data"
    write_split(root, "eval", pair())
    train = write_split(root, "train", {"inputs": torch.zeros(3, 4)})
    assert str(refusal(root)) == (
        f"data.root: {train} must hold a tuple (inputs, targets) of two tensors"
    )
    train.write_bytes(b"not a torch file at all")
    assert str(refusal(root)).startswith(f"data.root: {train} is not a readable torch file")
    write_split(root, "train", pair())
    assert len(tensor_files(str(root), features=4, classes=2, batch_size=8).eval_batches()) == 4
