"""Tables 2 and 3 recipe: the sweep files, the simulation from per-layer costs, the batch fit,
the collection of the runs' summaries, and the quick run end to end."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from giantpipe.cli import register_configs
from giantpipe.perf.costs import measure_layers
from giantpipe.perf.planner import DeviceSpec
from giantpipe.perf.simulate import StageCost
from tests.recipes.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recipe() -> ModuleType:
    return load_script("recipes/table2_throughput.py")


@pytest.mark.parametrize(
    ("sweep", "grid"),
    [("table2", {"pipeline.num_devices": "2,4,8", "pipeline.chunks": "1,4,32"}),
     ("table2_pcie", {"pipeline.num_devices": "2,4,8", "pipeline.chunks": "32"})],
)  # fmt: skip
def test_sweep_files_hold_the_papers_grid(sweep: str, grid: dict) -> None:
    register_configs(ROOT / "conf")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", [f"sweep={sweep}"], return_hydra_config=True)
    assert dict(cfg.hydra.sweeper.params) == grid


def test_ideal_is_the_bubble_model_normalized(recipe: ModuleType) -> None:
    assert recipe.ideal((2, 1), (2, 1)) == 1.0
    assert recipe.ideal((8, 32), (2, 1)) == pytest.approx(8 * 32 / 39)
    assert recipe.ideal((4, 32), (2, 32)) == pytest.approx((4 * 32 / 35) / (2 * 32 / 33))
    assert recipe.normalized({(2, 1): 4.0, (4, 1): 6.0}, (2, 1)) == {(2, 1): 1.0, (4, 1): 1.5}
    assert recipe.normalized({(4, 1): 6.0}, (2, 1)) == {}  # no base, no normalized cells


def test_merge_adds_times_and_keeps_inner_inputs(recipe: ModuleType) -> None:
    a = StageCost(1.0, 2.0, input_bytes=10, activation_bytes=100, static_bytes=5, send=0.5)
    b = StageCost(3.0, 4.0, input_bytes=20, activation_bytes=200, static_bytes=7, send=0.25)
    stage = recipe.merge([a, b])
    assert (stage.forward, stage.backward, stage.recompute) == (4.0, 6.0, 4.0)
    assert stage.input_bytes == 10 and stage.send == 0.25 and stage.static_bytes == 12
    assert stage.activation_bytes == 100 + 200 + 20  # b's input is saved inside the stage


def test_simulated_step_without_micro_batches_is_every_layer_in_turn(recipe: ModuleType) -> None:
    layers = [StageCost(float(i), 2.0 * i) for i in range(1, 7)]
    total = sum(c.forward + c.backward for c in layers)
    assert recipe.simulate_profile(layers, 2, 1, "never") == pytest.approx(total)
    # equal stages (2 layers of 1 + 2 s each): fill-drain takes (M + K - 1) x (F + B)
    equal = [StageCost(1.0, 2.0)] * 8
    assert recipe.simulate_profile(equal, 4, 32, "never") == pytest.approx((32 + 3) * 6.0)


def _meta_mlp_costs() -> list:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    return measure_layers(model, torch.empty(1, 1024, device="meta"))


def test_fit_batch_takes_the_largest_fast_batch_that_fits(recipe: ModuleType) -> None:
    costs = _meta_mlp_costs()  # 16 MiB of weights; x 3 with gradients and one optimizer slot
    device = DeviceSpec(peak_flops=1e12, memory_bytes=64 * 2**20, link_bandwidth=1e9)
    batch, rate, checkpoint = recipe.fit_batch(costs, 2, 4, device, max_batch=2**20)
    assert batch % 4 == 0 and rate > 0 and checkpoint in ("always", "except_last")
    assert recipe.fit_batch(costs, 2, 4, device, max_batch=2) is None  # below M: nothing tried
    small = DeviceSpec(peak_flops=1e12, memory_bytes=8 * 2**20, link_bandwidth=1e9)
    assert recipe.fit_batch(costs, 2, 4, small, max_batch=2**20) is None  # weights alone: no


def test_collect_reads_completed_runs_and_skips_failed_ones(
    recipe: ModuleType, tmp_path: Path
) -> None:
    runs = {
        "0": {"status": "completed", "pipeline/devices": ["cpu", "cpu"], "pipeline/chunks": 4,
              "train/samples_per_s": 12.5, "pipeline/bubble": 0.2},
        "1": {"status": "failed", "error": "boom"},
    }  # fmt: skip
    for name, summary in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    results = recipe.Results()
    recipe.collect(tmp_path, results)
    assert results.measured == {(2, 4): 12.5} and results.measured_bubble == {(2, 4): 0.2}


def test_every_paper_cell_is_in_the_grid_and_quoted_once(recipe: ModuleType) -> None:
    for model in recipe.MODELS:
        assert set(recipe.PAPER[model.key]) == set(model.cells)
        assert model.device in recipe.DEVICES
    assert set(recipe.TORCHGPIPE) == set(recipe.MODELS[0].cells)


@pytest.mark.slow
def test_quick_run_measures_simulates_and_writes_the_table(
    recipe: ModuleType, tmp_path: Path
) -> None:
    # main() in this process (one start-up of Python and torch less); its sweeps still run
    # ``train.py -m`` in their own processes. It sets one intra-op thread: put the count back.
    out = tmp_path / "table2"
    threads = torch.get_num_threads()
    try:
        assert recipe.main(["--quick", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (out / "table2.md").read_text()
    assert "## Table 2: AmoebaNet-D (18, 256)" in text and "## Table 3: Transformer-24" in text
    assert "**measured** CPU" in text and "**simulated** CPU profile" in text
    assert text.count("| not run |") == 2 + 1  # K=4 is simulated only (Table 2: M=1, 4; Table 3)
    assert (out / "table2.png").stat().st_size > 10_000
    summaries = sorted(out.glob("runs/*/*/summary.json"))
    assert len(summaries) == 3  # two jobs of sweep=table2, one of sweep=table2_pcie
    for path in summaries:
        assert json.loads(path.read_text())["status"] == "completed"
