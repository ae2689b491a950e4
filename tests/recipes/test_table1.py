"""Table 1 recipe: the memory tracker, the per-stage measurement with the engine, the quick run.

The tracker is checked against hand counts and the engine's own saved-tensor accounting on real
CPU tensors, fake tensors against real ones, the M = 2 extrapolation against direct runs, and
the quick recipe run against the models' own parameter counts.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from giantpipe.engine.spec import PipelineSpec
from giantpipe.engine.stats import SavedTensorMeter
from giantpipe.perf.memory import LiveBytesTracker, StageLoss, TensorSpec
from giantpipe.perf.stage_memory import measure_stage, profile_layer_memory
from models.amoebanet import amoebanetd
from recipes.model_sizes import AmoebaNetD, TransformerL
from tests.support.scripts import load_script


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))  # fmt: skip


def _meta_mlp() -> nn.Sequential:
    with torch.device("meta"):
        return _mlp()


def _forward_growth(model: nn.Module, x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """Live-bytes growth of a forward and the engine meter's saved bytes for it."""
    meter = SavedTensorMeter(exclude=model.parameters())
    meter.ignore([x])
    with LiveBytesTracker() as mem:
        mem.track([*model.parameters(), x])
        before = mem.live
        with meter:
            y = model(x)
        return mem.live - before, meter.bytes, y


def test_tracker_matches_hand_count_and_engine_meter_on_real_tensors() -> None:
    model, x = _mlp(), torch.randn(8, 64, requires_grad=True)
    growth, saved, y = _forward_growth(model, x)
    # Kept: both ReLU outputs (saved for backward) and the logits; the pre-ReLU outputs die.
    assert growth == 2 * 8 * 256 * 4 + 8 * 10 * 4
    assert saved == 2 * 8 * 256 * 4  # the engine's CPU accounting: saved tensors only
    assert growth == saved + y.nbytes


def test_tracker_gives_the_same_bytes_under_fake_tensors() -> None:
    real = _forward_growth(_mlp(), torch.randn(8, 64, requires_grad=True))[0]
    with FakeTensorMode():
        model, x = _mlp(), torch.randn(8, 64, requires_grad=True)
        with LiveBytesTracker() as mem:
            mem.track([*model.parameters(), x])
            before = mem.live
            y = model(x)
            fake = mem.live - before
            y.sum().backward()
    assert fake == real


def test_tracker_frees_and_keeps_peak() -> None:
    with FakeTensorMode(), LiveBytesTracker() as mem:
        x = torch.empty(1024, 1024)
        y = (x * 2).relu()
        assert (mem.live, mem.peak) == (8 * 2**20, 12 * 2**20)
        del y
        assert mem.live == 4 * 2**20
        mem.reset_peak()
        assert mem.peak == 4 * 2**20


SPEC = TensorSpec((8, 64), torch.float32, grad=True)
LOSS = StageLoss(F.cross_entropy, TensorSpec((8,), torch.long))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_stage_step_under_fake_tensors_equals_real_cpu_tensors(checkpoint: str) -> None:
    kwargs = dict(chunks=4, recompute=checkpoint, stage_index=1, num_stages=2, loss=LOSS)
    real = measure_stage(_mlp(), SPEC, extrapolate=False, **kwargs)
    fake = measure_stage(_meta_mlp(), SPEC, extrapolate=False, **kwargs)
    assert real == fake
    params = sum(p.numel() for p in _mlp().parameters())
    assert real.params == params
    # weight + gradient + RMSProp slot: the paper's 12 bytes a parameter (+ step counters).
    assert 12 * params <= real.param_memory <= 12 * params + 4 * 16


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_extrapolation_from_two_microbatches_is_exact(checkpoint: str, position: str) -> None:
    spec = TensorSpec((8, 64), torch.float32, grad=position != "first")
    loss = LOSS if position == "last" else None
    kwargs = dict(recompute=checkpoint, stage_index=0 if position == "first" else 1,
                  num_stages=3, loss=loss)  # fmt: skip
    for chunks in (3, 6):
        direct = measure_stage(_meta_mlp(), spec, chunks=chunks, extrapolate=False, **kwargs)
        extrapolated = measure_stage(_meta_mlp(), spec, chunks=chunks, **kwargs)
        assert extrapolated.chunks_measured == f"2->{chunks}"
        assert extrapolated.peak == direct.peak


def test_amoebanet_stage_fake_equals_real_and_extrapolation_is_exact() -> None:
    def stage(device: str) -> nn.Sequential:
        torch.manual_seed(0)
        with torch.device(device):
            return amoebanetd(6, 16, num_classes=10, image_size=32)[:3]

    spec = TensorSpec((2, 3, 32, 32), torch.float32)
    kwargs = dict(chunks=3, recompute="always")
    real = measure_stage(stage("cpu"), spec, extrapolate=False, **kwargs)
    direct = measure_stage(stage("meta"), spec, extrapolate=False, **kwargs)
    extrapolated = measure_stage(stage("meta"), spec, **kwargs)
    assert real.peak == direct.peak == extrapolated.peak


@pytest.mark.parametrize("layers", [12, 36])
def test_amoebanet_template_expands_to_the_full_model(layers: int) -> None:
    # Same modules, same widths, same parameters: the same memory (the profile of a template
    # layer stands for every layer it expands to; the Transformer test below compares profiles).
    family = AmoebaNetD(batch=2, image_size=32, classes=10)
    template, full = family.template(16), family.build(layers, 16)

    def signature(layer: nn.Module) -> tuple[str, list[tuple[int, ...]]]:
        return repr(layer), [tuple(p.shape) for p in layer.parameters()]

    assert [signature(template[i]) for i in family.expand(layers)] == [
        signature(layer) for layer in full
    ]


def test_transformer_template_expands_to_the_full_model() -> None:
    family = TransformerL(batch=2, seq_len=16, d_model=64)
    spec, loss = family.input(2), family.loss(2)
    template = profile_layer_memory(family.template(64), spec, loss)
    full = profile_layer_memory(family.build(3, 64), spec, loss)
    assert [template[i] for i in family.expand(3)] == full


def _recipe() -> ModuleType:
    return load_script("recipes/table1_max_model_size.py")


@pytest.fixture(scope="module")
def recipe() -> ModuleType:
    return _recipe()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    recipe = _recipe()
    out = tmp_path_factory.mktemp("table1")
    return recipe, out, recipe.run(recipe.parse(["--quick", "--out", str(out)]))


def test_paper_settings_are_the_papers_columns(recipe: ModuleType) -> None:
    naive = recipe.paper_setting("Naive-1", 32, "always")
    assert naive == recipe.Setting("Naive-1", PipelineSpec((1,), chunks=1, recompute="never"))
    eight = recipe.paper_setting("Pipeline-8", 32, "always").spec
    assert (eight.num_stages, eight.chunks, eight.recompute, eight.schedule) == (
        8, 32, "always", "gpipe")  # fmt: skip
    family = TransformerL()
    assert recipe.paper_size(family, "1663") == (1663, 2048)
    assert recipe.paper_size(AmoebaNetD(), "(72,512)") == (72, 512)
    assert 0 < recipe.RESERVE < 1 and "torchgpipe" in recipe.RESERVE_SOURCE


def test_a_paper_column_fits_within_the_budget_less_the_reserve(recipe: ModuleType) -> None:
    setting = recipe.Setting.uncut("Pipeline-2", 2, chunks=4, recompute="always")
    cut = setting.spec.replace(balance=(7, 8))
    size = recipe.ModelSize(setting, 13, 2048, 10, cut, (9 * 2**30, 7 * 2**30))
    usable = int(16 * 2**30 * (1 - 0.1))
    column = recipe.PaperColumn("Pipeline-2", size, usable)
    assert column.peak == 9 * 2**30 and column.fits
    over = recipe.PaperColumn("Pipeline-2", size, 8 * 2**30)
    assert not over.fits  # the reserve eats it
    assert recipe.paper_note(over, 3.2).startswith("Pipeline-2 does not fit: 9.00 GiB per device")


def test_the_papers_activations_are_compared_in_gib_with_its_swapped_cells_put_back(
    recipe: ModuleType,
) -> None:
    # AmoebaNet's memory cells are decimal GB (318M x 12 B = 3.8 GB); Transformer-L's are GiB,
    # and its Naive-1 cells are printed swapped (282.2M x 12 B = 3.15 GiB is the parameters).
    amoeba = recipe.paper_activations_gib("AmoebaNet-D", "Naive-1", recipe.PAPER_AMOEBANET)
    assert amoeba == pytest.approx(6.26e9 / 2**30)
    assert recipe.paper_activations_gib("AmoebaNet-D", "Pipeline-8", recipe.PAPER_AMOEBANET) == (
        pytest.approx(26.24e9 / 2**30))  # fmt: skip
    transformer = recipe.PAPER_TRANSFORMER
    assert recipe.paper_activations_gib("Transformer-L", "Naive-1", transformer) == 11.7
    assert recipe.paper_activations_gib("Transformer-L", "Pipeline-1", transformer) == 6.4
    # A column whose activations are exactly the paper's, in GiB, reads 1.0x (not 1.1x).
    setting = recipe.Setting.uncut("Naive-1", 1, chunks=1, recompute="never")
    params = 82_000_000
    peak = int(12 * params + amoeba * 2**30)
    size = recipe.ModelSize(setting, 18, 208, params, setting.spec.replace(balance=(24,)), (peak,))
    note = recipe.paper_note(recipe.PaperColumn("Naive-1", size, 2**30), amoeba)
    assert "are 1.0x the paper's 5.83 GiB" in note and "would be 0.50x" in note


@pytest.mark.slow
def test_quick_run_writes_the_table_and_the_plot(quick_run) -> None:  # type: ignore[no-untyped-def]
    _, out, results = quick_run
    text = (out / "table1.md").read_text()
    assert "sized under fake tensors (not measured on a GPU)" in text or "measured with" in text
    for label in ("Naive-1", "Pipeline-1", "Pipeline-2", "(18,544)", "785.8M", "does not fit"):
        assert label in text
    assert text.index("## 1. The paper's settings") < text.index("## 2. Our own search")
    assert (out / "table1.png").stat().st_size > 10_000
    assert set(results.search) == {"AmoebaNet-D", "Transformer-L"}
    assert set(results.paper) == {"Transformer-L"}  # --quick: AmoebaNet's are minutes


@pytest.mark.slow
def test_quick_run_sizes_the_papers_transformers_at_the_papers_settings(quick_run) -> None:  # type: ignore[no-untyped-def]
    recipe, _, results = quick_run
    columns = {c.label: c for c in results.paper["Transformer-L"]}
    family = TransformerL()
    for label, layers in (("Naive-1", 3), ("Pipeline-1", 13), ("Pipeline-8", 103)):
        size = columns[label].size
        assert size.layers == layers  # the paper's own model, not a searched one
        model = family.build(size.layers, size.width)
        assert size.params == sum(p.numel() for p in model.parameters())
        assert columns[label].usable == int(16 * 2**30 * (1 - recipe.RESERVE))
    naive, one, eight = columns["Naive-1"], columns["Pipeline-1"], columns["Pipeline-8"]
    assert (naive.size.spec.chunks, naive.size.spec.recompute) == (1, "never")
    assert (one.size.spec.chunks, one.size.spec.recompute) == (32, "always")
    assert not naive.fits and one.fits and eight.fits  # 24 GiB of activations without M
    assert one.largest.layers > 13 and eight.largest.layers > 103
    assert one.largest.setting == one.size.setting  # the same settings


@pytest.mark.slow
def test_quick_run_fits_and_counts_parameters_as_the_models_do(quick_run) -> None:  # type: ignore[no-untyped-def]
    recipe, _, results = quick_run
    families = {"AmoebaNet-D": recipe.AmoebaNetD(), "Transformer-L": recipe.TransformerL()}
    budgets = {"AmoebaNet-D": 8 * 2**30, "Transformer-L": 16 * 2**30}
    for name, columns in results.search.items():
        for column in columns:
            size = column.result.size
            model = families[name].build(size.layers, size.width)  # on the meta device
            assert size.params == sum(p.numel() for p in model.parameters())
            assert sum(s.params for s in column.result.stages) == size.params
            assert sum(size.balance) == len(model)
            assert column.fits == (column.result.peak <= budgets[name])
    pipeline = results.search["Transformer-L"][-1]
    assert pipeline.fits and pipeline.result.size.spec.num_stages == 1
