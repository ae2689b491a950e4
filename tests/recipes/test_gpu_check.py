"""benchmarks/gpu_check.py: every case (the GPU tests of tests/gpu, neighbouring cases in one
pytest, and the measurements, each in a child process) runs on CPU stand-ins (so the script a lent
GPU runs has not rotted); a hanging case is a failure with every thread's stack, a wrong result
makes the script exit 1; the pieces a GPU run judges by (intervals of a profile, the host-read
recorder) do what they say."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_script("benchmarks/gpu_check.py")  # puts benchmarks/ on sys.path (gpu_perf)


NOT_PASSED = {  # what CPU stand-ins cannot judge is no pass; measured rows have no band yet
    "host-sync": "not run (CUDA only)",
    "overlap": "not run (needs 2 GPUs)",
    "throughput": "no band yet",
    "memory": "no band yet",
}


@pytest.mark.slow
def test_dry_run_runs_every_case_and_passes(check: ModuleType, capsys, tmp_path: Path) -> None:
    assert check.main(["--cpu-dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in check.CASES:
        assert f"## {name}: {NOT_PASSED.get(name, 'pass')} (" in out, name
    # the measured rows print their value and no verdict until a GPU run sets their band
    for row in ("memory: recompute never: measured/forecast", "throughput: giantpipe / pippy"):
        case, check_name = row.split(": ", 1)
        table = out.split(f"## {case}:")[1].split("## ")[0]
        assert f"| {check_name}" in table and "| no band yet | " in table, row
    proposed = out.split("## Bands this run proposes")[1]
    assert "no GPU's bands" in proposed and '"CPU stand-ins": {' in proposed
    assert '"memory: recompute never: measured/forecast": {"low": ' in proposed
    for precision in ("fp32", "bf16"):  # every schedule x mode, each its own row
        table = out.split(f"## transparency-{precision}")[1].split("## ")[0]
        for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"):
            for mode in ("always", "except_last", "never"):
                assert f"| {schedule} / {mode} | pass |" in table
    # what CPU stand-ins cannot prove says so rather than passing
    assert "| gpipe / except_last, stages on cpu + cuda:0 | CUDA only |" in out
    assert "| train_step zb-v | CUDA only | host reads:" in out
    assert "| copies between GPUs under compute | needs 2 GPUs |" in out
    assert "| K=2 gloo stand-in: zb-v (rank 1) | pass |" in out
    assert "Failures: 0" in out
    (report,) = tmp_path.glob("gpu_check_*_dry.md")
    assert "`python benchmarks/gpu_check.py --cpu-dry-run --out" in report.read_text()


def test_a_measured_row_is_judged_by_the_band_a_run_set(
    check: ModuleType, capsys, tmp_path: Path
) -> None:
    """A band (here one the dry run's memory ratio, 1.00, lies above) judges the row: FAIL,
    exit 1, the band and its report in the criterion; a bands file that does not read stops
    the run before any case, in one line."""
    bands = tmp_path / "bands.json"
    key = "memory: recompute never: measured/forecast"
    entry = {"low": 0.5, "high": 0.9, "from": "gpu_check_x_dry.md"}
    bands.write_text(json.dumps({"bands": {"CPU stand-ins": {key: entry}}}))
    argv = ["--cpu-dry-run", "--only", "memory", "--bands", str(bands)]
    assert check.main(argv) == 1
    out = capsys.readouterr().out
    assert "| recompute never: measured/forecast | FAIL | 1.00, 1.00 (" in out
    assert "| 0.50-0.90 (set from gpu_check_x_dry.md) |" in out
    assert "| recompute except_last: measured/forecast | no band yet |" in out
    assert "## memory: FAIL (" in out and f"- {key}" in out
    bands.write_text(json.dumps({"bands": {"CPU stand-ins": {key: {"low": 0.5}}}}))
    assert check.main(argv) == 2
    assert "bands.json: CPU stand-ins / memory: recompute never" in capsys.readouterr().err


def test_a_hanging_case_fails_with_every_threads_stack(check: ModuleType, capsys) -> None:
    # a stage that never returns: the test's own timeout (pytest-timeout's thread method, not
    # the parent's backstop) ends its pytest, printing where every thread waits
    argv = ["--cpu-dry-run", "--only", "front-door", "--inject", "hang", "--timeout", "3"]
    assert check.main(argv) == 1
    out = capsys.readouterr().out
    assert "## front-door: TIMEOUT" in out and "**timed out after 3 s**" in out
    assert "+ Timeout +" in out  # pytest-timeout's dump, at the test's timeout
    assert "in _stall" in out and "in front_door" in out  # the stalled stage, the waiting door
    assert "- front-door: timed out after 3 s" in out


def test_cases_sharing_a_pytest_each_get_their_rows_seconds_and_log(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run runs neighbouring cases of tests in one pytest (their start-ups were most of
    its time): each case gets its own tests' rows, the seconds from its first test's start (the
    first from the launch), its own failures' reports; the case the pytest hung in gets the
    stacks; the cases it never reached run again, each group in a pytest of its own."""
    from gpu_common import CaseResult

    from giantpipe.testing.gpu import GpuOptions

    dry = GpuOptions(dry=True, quick=False, gpus=0)
    names = ["transparency-bf16", "fp16-scaler", "front-door", "host-sync", "nccl"]
    assert check.groups(names, dry) == [names]
    assert check.groups(names, GpuOptions(dry=False, quick=False, gpus=1)) == [[n] for n in names]
    bf16 = "tests/gpu/test_transparency.py::test_bf16_is_no_worse_than_the_plain_model[zb-v-never]"
    fp16, door = "tests/gpu/test_fp16_scaler.py::test_x", "tests/gpu/test_front_door.py::test_y"

    def start(node: str, at: float) -> dict:
        return {"nodeid": node, "started": True, "timeout": 3, "time": at}

    def outcome(node: str, verdict: str, log: str = "") -> dict:
        props = [["check", node[-4:]], ["measured", "1e-7"]]
        return {"nodeid": node, "outcome": verdict, "when": "call", "properties": props,
                "reason": "", "log": log}  # fmt: skip

    records = [start(bf16, 110.0), outcome(bf16, "passed"), start(fp16, 130.0),
               outcome(fp16, "failed", "AssertionError: scale"), start(door, 135.0)]  # fmt: skip
    again: list[list[str]] = []
    monkeypatch.setattr(check, "run_group", lambda group, *_: again.append(group) or [
        CaseResult(name, 1.0) for name in group])  # fmt: skip
    stacks = "+ Timeout +\nThread 1: in _stall"
    got = check._shared_outcomes(names, (100.0, 140.0), records, stacks, 1, dry, 3.0)
    assert [case.name for case in got] == names
    assert again == [["host-sync", "nccl"]]  # never reached: run again, together
    bf16_case, fp16_case, door_case = got[:3]
    assert (bf16_case.verdict, bf16_case.seconds, bf16_case.log) == ("pass", 30.0, "")
    assert (fp16_case.verdict, fp16_case.seconds) == ("FAIL", 5.0)
    assert fp16_case.log == "AssertionError: scale" and fp16_case.problem is None
    assert door_case.problem == "timed out after 3 s" and door_case.seconds == 5.0
    assert door_case.log == stacks and door_case.rows == []


def test_a_wrong_transparency_result_exits_1(check: ModuleType, capsys) -> None:
    argv = ["--cpu-dry-run", "--only", "transparency-fp32", "--inject", "wrong"]
    assert check.main(argv) == 1
    out = capsys.readouterr().out
    assert "## transparency-fp32: FAIL" in out
    assert "| zb-v / never | FAIL |" in out and "- transparency-fp32: gpipe / always" in out


def test_the_nccl_case_on_one_gpu_is_not_run_rather_than_passed(check: ModuleType) -> None:
    """Issue 32, item 6: on one GPU the nccl case ran a world of one rank, which sends nothing
    over NCCL, and reported a pass. Now every row of a one-GPU run skips as "needs 2 GPUs" (no
    world of one is left), and a case none of whose rows could be judged says so."""
    from giantpipe.testing.gpu import TWO_GPUS, GpuOptions
    from tests.gpu.nccl_world import ROWS, nccl_row  # each of test_nccl's tests is one call

    assert {world for world, _, _ in ROWS} == {2}
    one_gpu = GpuOptions(dry=False, quick=True, gpus=1)
    records = []
    for world, rank, name in ROWS:
        props: list[tuple[str, object]] = []
        with pytest.raises(pytest.skip.Exception, match=TWO_GPUS):
            nccl_row(
                world, rank, name, one_gpu, lambda key, value, into=props: into.append((key, value))
            )
        node = f"tests/gpu/test_nccl.py::test_each_rank_equals_the_plain_model[{rank}-{name}]"
        records.append(
            {"nodeid": node, "outcome": "skipped", "when": "call", "properties": props,
             "reason": TWO_GPUS}
        )  # fmt: skip
    case = check._tests_outcome("nccl", 1.0, records, "", 0)
    assert case.verdict == "not run (needs 2 GPUs)" and not case.failed
    assert {row[1] for row in case.rows} == {TWO_GPUS}
    assert "## nccl: not run (needs 2 GPUs) (" in check.section(case)
    assert "| nccl | not run (needs 2 GPUs) |" in check.summary([case], 1.0, None)


def test_the_results_readme_lists_the_cases_a_run_has(check: ModuleType) -> None:
    """results/gpu/README.md says what a run proves case by case: exactly the script's cases
    (it once promised a one-rank NCCL check after that case had gone)."""
    text = (Path(check.ROOT) / "results" / "gpu" / "README.md").read_text()
    listed = [line.split("`")[1] for line in text.splitlines() if line.startswith("| `")]
    assert listed == list(check.CASES)


def test_list_names_every_case(check: ModuleType, capsys) -> None:
    assert check.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == list(check.CASES)


def test_covered_is_the_fraction_of_copy_time_under_compute(check: ModuleType) -> None:
    import gpu_perf

    assert gpu_perf.covered([(0, 10)], [(2, 4), (3, 6), (8, 20)]) == pytest.approx(0.6)
    assert gpu_perf.covered([(0, 4), (10, 14)], [(0, 14)]) == 1.0
    assert gpu_perf.covered([(0, 4)], []) == 0.0
    assert gpu_perf.covered([], [(0, 1)]) == 0.0


def test_host_reads_records_each_read_where_it_was_made_and_restores_tensor(
    check: ModuleType,
) -> None:
    from tests.gpu import sync

    before = torch.Tensor.item
    with sync.host_reads() as seen:
        value = torch.ones(()).item()
        bool(torch.ones(()))
    assert value == 1.0
    assert [p.what for p in seen] == ["item()", "__bool__()"]
    assert all(p.where.startswith("test_gpu_check.py:") for p in seen)
    assert torch.Tensor.item is before and "item" not in torch.Tensor.__dict__


def test_device_activity_sorts_a_profiles_gpu_events_into_copies_and_kernels(
    check: ModuleType,
) -> None:
    from types import SimpleNamespace

    import gpu_perf
    from torch.autograd import DeviceType

    def event(name: str, device: int, start: float, end: float, kind: object) -> object:
        span = SimpleNamespace(start=start, end=end)
        return SimpleNamespace(name=name, device_index=device, time_range=span, device_type=kind)

    events = [
        event("Memcpy PtoP (Device -> Device)", 1, 0, 10, DeviceType.CUDA),
        event("ampere_sgemm_128x64_nn", 1, 5, 20, DeviceType.CUDA),
        event("Memset (Device)", 1, 0, 30, DeviceType.CUDA),  # neither copy nor compute
        event("aten::addmm", -1, 0, 30, DeviceType.CPU),  # the host's view of the kernel
        event("Memcpy DtoD (Device -> Device)", 0, 40, 50, DeviceType.CUDA),
    ]
    activity = gpu_perf.device_activity(SimpleNamespace(events=lambda: events))
    assert activity == {1: ([(0.0, 10.0)], [(5.0, 20.0)]), 0: ([(40.0, 50.0)], [])}


def test_cuda_syncs_records_a_sync_warning_of_any_thread_with_its_place(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import warnings

    from tests.gpu import sync

    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)  # needs no GPU now

    def worker() -> None:  # as a worker thread calling a synchronising op would
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)

    with sync.cuda_syncs() as seen:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert modes == ["warn", "default"]
    assert [p.what for p in seen] == ["called a synchronizing CUDA operation"]
    assert seen[0].where.startswith("test_gpu_check.py:")
