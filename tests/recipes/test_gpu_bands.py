"""benchmarks/gpu_bands.py: a measured row of the GPU check is judged by the band a GPU run set
from its data (results/gpu/bands.json), prints "no band yet" without one, and every run
proposes bands from what it measured; a bands file that does not read is refused in one line."""

from __future__ import annotations

import doctest
import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.scripts import ROOT, load_script


@pytest.fixture(scope="module")
def bands() -> ModuleType:
    load_script("benchmarks/gpu_check.py")  # puts benchmarks/ on sys.path (gpu_common)
    return load_script("benchmarks/gpu_bands.py")


def measured_case(gpu_common: ModuleType) -> object:
    """A memory case as a child reports it: two devices' ratios, no band applied yet."""
    section = gpu_common.Section()
    section.banded("recompute never: measured/forecast", [0.98, 1.04], "0.98, 1.04", "both")
    section.add("a printed figure", gpu_common.INFO, "3.0", "-")
    case = gpu_common.CaseResult("memory", 1.0)
    case.rows = [list(row) for row in section.rows]
    case.measured = section.measured
    return case


def test_the_examples_in_the_module_hold(bands: ModuleType) -> None:
    assert doctest.testmod(bands).failed == 0


def test_a_row_is_judged_by_its_band_and_says_so_without_one(bands: ModuleType) -> None:
    import gpu_common

    key = "memory: recompute never: measured/forecast"
    case = measured_case(gpu_common)
    bands.judge(case, {})
    assert case.rows[0][1:3] == ["no band yet", "0.98, 1.04"]
    assert case.rows[0][3] == "a GPU run's data sets it (results/gpu/README.md)"
    assert case.verdict == "no band yet" and not case.failed
    case = measured_case(gpu_common)
    bands.judge(case, {key: bands.Band(0.9, 1.1, "r_full.md")})
    assert case.rows[0][1] == "pass" and case.rows[0][3] == "0.90-1.10 (set from r_full.md)"
    assert case.verdict == "pass"
    case = measured_case(gpu_common)
    bands.judge(case, {key: bands.Band(1.0, None, "r.md")})  # one device's ratio under the floor
    assert case.rows[0][1] == "FAIL" and case.rows[0][3] == ">= 1.00 (set from r.md)"
    assert case.failed == ["memory: recompute never: measured/forecast"]


def test_a_run_proposes_bands_beyond_the_range_it_measured(bands: ModuleType) -> None:
    import gpu_common

    section = gpu_common.Section()
    section.banded("giantpipe / pippy, one GPU", [1.0], "1.00", "floor", seen=[0.9, 1.0, 1.1])
    case = gpu_common.CaseResult("throughput", 1.0, measured=section.measured)
    text = bands.proposals([measured_case(gpu_common), case], "full, 1 GPU", "r.md")
    block = json.loads(text.split("```json")[1].split("```")[0])
    memory, speed = "memory: recompute never: measured/forecast", "throughput: giantpipe / pippy"
    assert block == {
        "full, 1 GPU": {
            memory: {"low": 0.88, "high": 1.14, "from": "r.md"},  # 0.98 - 10%, 1.04 + 10%
            f"{speed}, one GPU": {"low": 0.81, "high": None, "from": "r.md"},  # the least round
        }
    }
    path = Path("bands.json")
    proposed = {k: bands._band(path, k, v) for k, v in block["full, 1 GPU"].items()}
    assert proposed["throughput: giantpipe / pippy, one GPU"].holds([0.85])  # the file takes it
    assert "no GPU's bands" in bands.proposals([case], "CPU stand-ins", "r.md")


def test_the_bands_file_is_read_or_refused_naming_the_entry(
    bands: ModuleType, tmp_path: Path
) -> None:
    assert bands.load(tmp_path / "absent.json") == {}
    assert bands.load(ROOT / "results" / "gpu" / "bands.json") is not None  # the tracked one reads
    path = tmp_path / "bands.json"
    good = {"low": 0.9, "high": None, "from": "r.md"}
    path.write_text(json.dumps({"bands": {"full, 1 GPU": {"memory: x": good}}}))
    assert bands.load(path) == {"full, 1 GPU": {"memory: x": bands.Band(0.9, None, "r.md")}}
    for entry, message in [
        ({"low": 0.9}, r"full, 1 GPU / memory: x: expected the keys \['from', 'high', 'low'\]"),
        ({"low": None, "high": None, "from": "r"}, "not both null"),
        ({"low": 1.2, "high": 1.1, "from": "r"}, "low 1.2 is above high 1.1"),
        ({"low": "0.9", "high": None, "from": "r"}, "numbers or null"),
    ]:
        path.write_text(json.dumps({"bands": {"full, 1 GPU": {"memory: x": entry}}}))
        with pytest.raises(ValueError, match=message):
            bands.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="bands.json: not JSON"):
        bands.load(path)
