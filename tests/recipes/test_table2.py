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

from giantpipe.cli.registration import register_configs
from giantpipe.perf.costs import measure_layers
from giantpipe.perf.simulate import StageCost
from tests.support.scripts import load_script

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
    preset = recipe.Preset("test", 1e12, 64 / 1024, 1e11, 1e9, 0.5, 0.0, 0.0, 0.0, 0.1)
    fit = recipe.fit_batch(costs, 2, 4, preset, max_batch=2**20)
    assert fit.batch % 4 == 0 and fit.samples_per_s > 0 and sum(fit.balance) == 4
    assert recipe.fit_batch(costs, 2, 4, preset, max_batch=2) is None  # below M: nothing tried
    small = recipe.replace(preset, memory_gib=8 / 1024)
    assert recipe.fit_batch(costs, 2, 4, small, max_batch=2**20) is None  # weights alone: no


def test_the_papers_cells_re_materialize_even_at_one_micro_batch(recipe: ModuleType) -> None:
    # The paper re-materialized in every cell: at M=1 the backward replays the forward, so
    # the step is slower than without (one forward of four passes more).
    costs = _meta_mlp_costs()
    preset = recipe.Preset("test", 1e12, 1.0, 1e11, 1e9, 0.5, 0.0, 0.0, 0.0, 0.1)
    always = recipe.device_cell(costs, 2, 1, 64, [2, 2], preset)
    never = recipe.device_cell(costs, 2, 1, 64, [2, 2], preset, "never")
    assert always < never
    fit = recipe.fit_batch(costs, 2, 1, preset, max_batch=64)
    assert fit.samples_per_s == pytest.approx(
        recipe.device_cell(costs, 2, 1, fit.batch, fit.balance, preset, "always")
    )


def test_every_constant_is_a_flag_and_says_where_it_comes_from(recipe: ModuleType) -> None:
    fields = {name for name, _ in recipe.FLAGS.values()}
    for name, preset in recipe.PRESETS.items():
        assert set(preset.sources) == fields, name  # a source for every constant
    args = recipe.parse(["--device", "p40", "--link-gbps", "12", "--half-batch", "8"])
    presets = recipe.presets_from(args)
    p40 = presets["p40"]
    assert p40.link_bandwidth == 12e9 and p40.half_batch == 8
    assert "link_bandwidth" not in p40.sources  # reported as 'command line'
    assert presets["v100"] == recipe.PRESETS["v100"]  # only the named preset changes
    table = recipe.preset_table(["p40"], presets)
    assert "| p40 | link_bandwidth | 12 GB/s | command line |" in table


def test_p40_preset_reproduces_torchgpipes_cells(recipe: ModuleType) -> None:
    # torchgpipe's 8 x P40 re-run at its own batch, balance and re-materialization: the P40
    # preset's raw samples/s within 15% in 8 of 9 cells, the ninth named in MISSING.
    model = recipe.MODELS[0]
    costs = recipe.full_size_costs(model)
    p40 = recipe.PRESETS["p40"]
    off = []
    for cell, (batch, rate, _, balance, checkpoint) in recipe.TORCHGPIPE.items():
        simulated = recipe.device_cell(costs, *cell, batch, balance, p40, checkpoint)
        if abs(simulated / rate - 1) > recipe.TOLERANCE:
            off.append(cell)
    assert off == [(4, 4)] and ("torchgpipe", (4, 4)) in recipe.MISSING


def test_each_note_quotes_its_own_cells_numbers(recipe: ModuleType) -> None:
    # A note names the missing effect with the cell's own figures, not one cell's for all.
    r = recipe.Results()
    for cell, rate in {(2, 1): 100.0, (4, 1): 103.0, (4, 4): 172.0, (8, 4): 249.0}.items():
        r.device_sim[cell] = recipe.Fit(4 * cell[1], rate, (6,) * cell[0])
    k4 = recipe.missing("amoebanet_t2", (4, 4), r)
    assert "gains the paper 1.12x over M=1 at K=4" in k4  # 1.26 / 1.13
    assert "bubble model's 2.29x and the simulation's 1.67x" in k4  # 172 / 103
    k8 = recipe.missing("amoebanet_t2", (8, 4), r)
    assert "1.25x over M=1 at K=8" in k8 and k8 != k4
    lm = recipe.missing("transformer_t2", (8, 4), r)
    assert "the paper's 4.8 is 1.65x the bubble model's 2.91" in lm
    tg = recipe.missing("torchgpipe", (4, 4), r)
    assert "0.73 of the bubble model's, against 0.96 at K=2 and 0.90 at K=8" in tg
    assert recipe.missing("amoebanet_t2", (2, 1), r) == "not diagnosed"


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
    assert results.breakdown[(2, 4)]["bubble"] == 0.2  # the run's Section 3.1 figures


def test_the_amoebanet_jobs_eval_loss_is_explained_beside_it(
    recipe: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each job prints its summary, with an eval loss of 1e4 to 1e33 for AmoebaNet after a few
    # steps (BatchNorm's running statistics in eval mode); the script says why beside it, once
    # per sweep, and nothing for the Transformers (no BatchNorm: their loss is near chance).
    jobs = {"0": ("amoebanet_d_speed", 1, 3.52e30), "1": ("amoebanet_d_speed", 4, 5.4e31)}
    for name, (recipe_name, chunks, loss) in jobs.items():
        (tmp_path / name).mkdir()
        summary = {"name": recipe_name, "status": "completed", "steps": 6, "eval/loss": loss,
                   "pipeline/devices": ["cpu", "cpu"], "pipeline/chunks": chunks,
                   "train/samples_per_s": 3.0}  # fmt: skip
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    recipe.collect(tmp_path, recipe.Results())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(lines) == 1
    assert lines[0].startswith("note: eval loss 3.52e+30 to 5.4e+31 above is BatchNorm's")
    assert "6 SGD steps on random pixels" in lines[0] and "samples/s is unaffected" in lines[0]
    lm = {"name": "transformer_lm_scaling", "steps": 6, "eval/loss": 6.65}
    assert recipe.eval_note([lm]) is None


def test_a_rerun_never_reads_the_previous_runs_summaries(
    recipe: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The committed results hold an earlier sweep; the runner refuses those job directories
    # (a record without a checkpoint), so a rerun must start them afresh, else ``collect``
    # reads the earlier, completed summaries as this run's numbers.
    model = recipe.MODELS[0]
    stale = tmp_path / "runs" / model.key / "0"
    stale.mkdir(parents=True)
    (stale / "summary.json").write_text(json.dumps({"status": "completed"}))
    monkeypatch.setattr(recipe.subprocess, "run", lambda *args, **kwargs: None)
    sweep_dir = recipe.run_sweep(model, 2, tmp_path)
    assert sweep_dir == tmp_path / "runs" / model.key
    assert not list(sweep_dir.glob("*/summary.json"))


def test_every_paper_cell_is_in_the_grid_and_quoted_once(recipe: ModuleType) -> None:
    for model in recipe.MODELS:
        assert set(recipe.PAPER[model.key]) == set(model.cells)
        assert model.device in recipe.PRESETS
    assert set(recipe.TORCHGPIPE) == set(recipe.MODELS[0].cells)
    for _, rate, speedup, balance, _ in recipe.TORCHGPIPE.values():
        assert sum(balance) == 24  # AmoebaNet-D (18, D): L + 6 layers
        # torchgpipe normalizes to its K=2, M=1 cell (speed-ups taken before rounding the rates)
        assert speedup == pytest.approx(rate / 26.7, abs=0.01)


@pytest.mark.slow
def test_quick_run_measures_simulates_and_writes_the_table(
    recipe: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # main() in this process (one start-up of Python and torch less); its sweeps still run
    # ``train.py -m`` in their own processes. It sets one intra-op thread: put the count back.
    out = tmp_path / "table2"
    threads = torch.get_num_threads()
    try:
        assert recipe.main(["--quick", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert printed.count("above is BatchNorm's, not learning's") == 1  # AmoebaNet's sweep only
    text = (out / "table2.md").read_text()
    assert "## Table 2: AmoebaNet-D (18, 256)" in text and "## Table 3: Transformer-24" in text
    assert "**measured** CPU" in text and "**simulated** CPU profile" in text
    assert "recompute share" in text and "## Device presets and their sources" in text
    assert "vs torchgpipe" in text and "TPUv3" not in text
    assert text.count("| not run |") == 2 + 1  # K=4 is simulated only (Table 2: M=1, 4; Table 3)
    assert (out / "table2.png").stat().st_size > 10_000
    summaries = sorted(out.glob("runs/*/*/summary.json"))
    assert len(summaries) == 3  # two jobs of sweep=table2, one of sweep=table2_pcie
    for path in summaries:
        assert json.loads(path.read_text())["status"] == "completed"
