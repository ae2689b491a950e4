"""Peers benchmark: its memory meter, its bound, the packing of pippy's arguments, the local
methods on a tiny model, and the quick run end to end (two gloo processes)."""

from __future__ import annotations

import mmap
import re
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    return load_script("benchmarks/peers.py")


def test_rss_growth_sees_a_tensor_that_lived_inside_the_body(peers: ModuleType) -> None:
    peaks: list[int] = []
    with peers.peak_rss_growth(peaks):
        # 64 MiB of fresh pages, touched (an allocator might reuse memory already resident).
        fresh = mmap.mmap(-1, 64 * 2**20)
        big = torch.frombuffer(fresh, dtype=torch.uint8).fill_(1)
        time.sleep(0.2)  # the sampler runs every millisecond, when a busy machine lets it
        del big
        fresh.close()
    assert 60 * 2**20 < peaks[0] < 200 * 2**20


def test_bound_is_engine_cpus(peers: ModuleType) -> None:
    result = peers.Result(rate={("plain-mb", 4): 10.0}, peak={}, balances={}, batch=8)
    assert peers.bound(result, 4) == pytest.approx(2 * 10.0 * 4 / 5)


def test_unpack_hands_a_tuple_on_as_one_input(peers: ModuleType) -> None:
    seen = []
    inner = torch.nn.Sequential(torch.nn.Identity())
    inner.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    unpack = peers.Unpack(inner)
    a, b = torch.ones(1), torch.zeros(1)
    unpack(a, b)
    unpack(a)
    assert isinstance(seen[0], tuple) and len(seen[0]) == 2 and seen[1] is a


@pytest.mark.parametrize("name", ["mlp", "amoebanet", "transformer"])
def test_every_local_method_takes_a_step_on_the_quick_models(peers: ModuleType, name: str) -> None:
    model, x, y = peers.build(name, quick=True)
    steps = peers.local_steps(model, x, y, 2, [len(model) // 2, len(model) - len(model) // 2])
    assert set(steps) == set(peers.LOCAL)
    for step in steps.values():
        step()


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_fills_every_cell(peers: ModuleType, tmp_path: Path) -> None:
    # main() in this process (one start-up of Python and torch less); the benchmark still starts
    # its gloo pairs and its memory-pass child process (OMP_NUM_THREADS=1 there) as on the command
    # line. One thread here too, as the command line's re-exec gives the local methods.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert peers.main(["--quick", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "peers.md").read_text()
    rows = [
        line for line in text.splitlines() if re.match(r"\| [12] \| [\d.]+ \| [\d.]+ \| ", line)
    ]
    assert len(rows) == 3 * 2 * 2  # 3 models x M in (1, 2) x (throughput, memory)
    for row in rows:
        assert row.count(" - ") <= 1, row  # only pippy-1f1b at M=1 is empty
    assert "OMP_NUM_THREADS=1" in text
    assert (tmp_path / "peers.png").stat().st_size > 10_000
