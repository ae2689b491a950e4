"""benchmarks/gpu_check.py --cpu-dry-run: every section of the GPU check runs on CPU stand-ins,
so the script a lent GPU runs has not rotted."""

from __future__ import annotations

from tests.recipes.scripts import load_script


def test_dry_run_checks_transparency_speed_forecast_and_memory(capsys) -> None:
    script = load_script("benchmarks/gpu_check.py")
    assert script.main(["--cpu-dry-run"]) == 0
    out = capsys.readouterr().out
    for k in (2, 4):
        assert f"## K = {k}" in out
        for precision in ("fp32", "bf16"):
            for check in ("loss", "gradients", "no_grad outputs"):
                assert f"| K={k} {precision} {check} | yes |" in out
    assert out.count("| giantpipe |") == 2 and out.count("| plain (one device) |") == 2
    assert out.count("| measured / predicted |") == 2
    assert "transparency failures: 0" in out
