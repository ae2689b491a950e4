"""The GPU acceptance check: one script that says whether the engine's GPU path is right and how
fast it is, each case in a process of its own with a timeout, so a hang is a failure with every
thread's stack, not a stall, and the report written to a file.

    python benchmarks/gpu_check.py --out results/gpu   # one GPU or more: under 8 minutes
    python benchmarks/gpu_check.py --quick             # the short budget: under 3 minutes
    python benchmarks/gpu_check.py --cpu-dry-run       # the same cases on CPU stand-ins, tiny
    python benchmarks/gpu_check.py --list              # the cases and what each proves
    python benchmarks/gpu_check.py --only front-door   # one case (repeatable)

Hardware: meant for one H200 (any CUDA GPU will do); a second GPU adds the copies between
GPUs, their overlap with compute and the distributed executor at K=2 over NCCL. What one GPU
cannot prove is printed as "needs 2 GPUs", what CPU stand-ins cannot as "CUDA only"; a case
none of whose rows could be judged is "not run (needs 2 GPUs)", never a pass.

The cases: the GPU tests (tests/gpu, ``python -m pytest -m gpu``; on GPUs this script runs each
case's tests in a pytest of its own, a dry run neighbouring cases in one) and the speed and
memory measurements (gpu_measure.py)::

    transparency-fp32   every schedule x re-materialization mode equals the plain model, fp32
    transparency-bf16   the same in bf16: error vs fp32 no worse than 1.5x the plain bf16 model's
    fp16-scaler         fp16 with a gradient scaler: gradients, skipped steps, the scale
    front-door          y = pipe(x); loss.backward() equals the plain model (and does not hang)
    host-sync           no synchronising CUDA call inside a step (sync debug mode 'warn')
    overlap             copies between two GPUs overlap compute
    throughput          samples/s against the plain model, torchgpipe and pippy
    memory              allocator peak against predict(pipe, ...)'s forecast
    nccl                DistributedPipe over NCCL, one rank per GPU, equals the plain model
    replicas            K=2 x R=2 over NCCL, each stage on FSDP2 (full, grads, none; bf16's
                        policy): equals the plain model; needs 4 GPUs, skipped with fewer

Each case prints a markdown table (check, verdict, measured, criterion: a test's row, or a
measurement's) and its seconds; a summary lists the failures and the bands the run proposes; the
exit status is 1 when any check failed, timed out or crashed. With ``--out DIR`` the report is
also written to DIR, with the date and the command.

The tests' tolerances are derived (fp32: float noise of reordered sums; low precision: the plain
model's own error) and fail hard; memory, speed and overlap are judged by bands a GPU run set
from its data (``--bands``, default results/gpu/bands.json): until then such a row prints its
value and "no band yet" (results/gpu/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "src", ROOT / "benchmarks"):  # run from a checkout
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import gpu_bands  # noqa: E402

from giantpipe.testing.gpu import INJECTIONS, ROWS, TIMEOUT, GpuOptions, ceiling  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="CPU stand-ins, tiny sizes")
    parser.add_argument("--quick", action="store_true", help="the short budget (< 3 minutes)")
    parser.add_argument("--only", action="append", metavar="CASE", help="run only CASE")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument(
        "--timeout", type=float, help="seconds per test or measurement (default: its own)"
    )
    parser.add_argument("--out", type=Path, help="also write the report into this directory")
    parser.add_argument(
        "--bands", type=Path, default=gpu_bands.BANDS, help="the bands measured rows are judged by"
    )
    # test-only: proves that a hang and a wrong result are reported as failures
    parser.add_argument("--inject", choices=INJECTIONS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch  # noqa: E402
from gpu_common import FAIL, CaseResult  # noqa: E402
from gpu_measure import MEASUREMENTS, kill_group, run_measurement  # noqa: E402

BUDGET_S = {"full": 480.0, "quick": 180.0}  # the whole run on one H200
BACKSTOP_S = 900.0  # a pytest that its own timeouts did not end: killed after this long
TIMED_OUT = "+ Timeout +"  # pytest-timeout's banner over every thread's stack


@dataclass(frozen=True)
class Case:
    """A case: what it proves (one line), and the GPU tests it runs (pytest node ids under
    tests/gpu), or none for a measurement of gpu_measure.py."""

    proves: str
    tests: tuple[str, ...] = ()


def _tests(path: str, *names: str) -> tuple[str, ...]:
    return tuple(f"tests/gpu/{path}::{name}" for name in names) or (f"tests/gpu/{path}",)


CASES: dict[str, Case] = {
    "transparency-fp32": Case(
        "every schedule x re-materialization mode equals the plain model, fp32",
        _tests(
            "test_transparency.py",
            "test_fp32_equals_the_plain_model",
            "test_fp32_stages_on_the_host_and_a_gpu",
        ),
    ),
    "transparency-bf16": Case(
        "every schedule x mode in bf16: error vs fp32 no worse than plain bf16",
        _tests("test_transparency.py", "test_bf16_is_no_worse_than_the_plain_model"),
    ),
    "fp16-scaler": Case(
        "fp16 with a gradient scaler: steps, skips and scales", _tests("test_fp16_scaler.py")
    ),
    "front-door": Case(
        "y = pipe(x); loss.backward() equals the plain model", _tests("test_front_door.py")
    ),
    "host-sync": Case("no host synchronisation inside a step", _tests("test_host_sync.py")),
    **{name: Case(measurement.proves) for name, measurement in MEASUREMENTS.items()},
    "nccl": Case("DistributedPipe over NCCL equals the plain model", _tests("test_nccl.py")),
    "replicas": Case(
        "K=2 x R=2 over NCCL, stages on FSDP2, each sharding equals the plain model (4 GPUs)",
        _tests("test_replicas.py"),
    ),
}
"""Every case, in the order a run takes them (correctness first: a short loan proves most)."""


# ---- running a case ----------------------------------------------------------------------------


def groups(names: list[str], opts: GpuOptions) -> list[list[str]]:
    """The cases ``names`` in the processes they run in, in order: on GPUs each case alone (a
    CUDA context, and a hang, of its own); in a dry run neighbouring cases of tests share one
    pytest, whose start-up is most of what a case costs on CPU stand-ins.

    >>> groups(["front-door", "host-sync", "memory", "nccl"], GpuOptions(True, True, 0))
    [['front-door', 'host-sync'], ['memory'], ['nccl']]
    """
    out: list[list[str]] = []
    for name in names:
        if opts.dry and out and CASES[name].tests and CASES[out[-1][-1]].tests:
            out[-1].append(name)
        else:
            out.append([name])
    return out


def run_group(names: list[str], opts: GpuOptions, timeout: float | None) -> list[CaseResult]:
    """Runs one of :func:`groups`: its tests in a pytest, or its measurement in a child."""
    (name, *_) = names
    if CASES[name].tests:
        return run_tests(names, opts, timeout)
    return [run_measurement(name, opts, timeout or ceiling(MEASUREMENTS[name].timeout, opts.env()))]


def run_tests(names: list[str], opts: GpuOptions, timeout: float | None) -> list[CaseResult]:
    """``python -m pytest -m gpu TESTS`` over the tests of cases ``names``, in its own process
    group, seeing ``opts`` (and ``timeout`` seconds per test, else each test's own); each
    test's row read back from the rows file the tests' conftest writes. A test that hangs ends
    its pytest with every thread's stack (pytest-timeout's ``thread`` method); the cases after
    it run again in a pytest of their own."""
    env = {**os.environ, **opts.env(), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    if timeout is not None:
        env[TIMEOUT] = str(timeout)
    tests = [test for name in names for test in CASES[name].tests]
    command = [sys.executable, "-m", "pytest", *tests, "-m", "gpu", "-n", "0",
               "-p", "no:cacheprovider", "-q"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        rows = Path(tmp, "rows.jsonl")
        env[ROWS] = str(rows)
        started = time.time()
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, text=True, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            log, _ = proc.communicate(timeout=BACKSTOP_S)
        except subprocess.TimeoutExpired:  # pytest-timeout did not end it: nothing else will
            kill_group(proc.pid)
            log, _ = proc.communicate()
        kill_group(proc.pid)  # ranks or workers the tests left behind
        ended = time.time()
        lines = rows.read_text().splitlines() if rows.exists() else []
    records = [json.loads(line) for line in lines]
    if len(names) == 1:
        return [_tests_outcome(names[0], ended - started, records, log, proc.returncode)]
    return _shared_outcomes(names, (started, ended), records, log, proc.returncode, opts, timeout)


def _shared_outcomes(
    names: list[str],
    span: tuple[float, float],
    records: list[dict],
    log: str,
    code: int,
    opts: GpuOptions,
    timeout: float | None,
) -> list[CaseResult]:
    """Each case of one pytest run over several: its records, and the seconds from its first
    test's start to the next case's (the first case's counted from the launch, the last's to
    the end). The case in whose test the pytest ended early (a timeout, a crash) takes its
    whole output and exit status; the others their own failures' reports; the cases it never
    started run again."""
    mine: dict[str | None, list[dict]] = {name: [] for name in names}
    firsts: dict[str, float] = {}  # each case's first test's start (records come in order)
    for r in records:
        case = _case_of(r["nodeid"], names)
        mine.setdefault(case, []).append(r)
        if case is not None and r.get("started"):
            firsts.setdefault(case, r["time"])
    begun = list(firsts)
    failed = any(r.get("outcome") == "failed" for r in records)
    early = TIMED_OUT in log or code not in (0, 1) or (code == 1 and not failed)
    last = begun[-1] if begun and early else None
    out = []
    for i, name in enumerate(begun):
        start = span[0] if i == 0 else firsts[name]
        end = firsts[begun[i + 1]] if i + 1 < len(begun) else span[1]
        own = "\n".join(r["log"] for r in mine[name] if r.get("log"))
        fails = any(r.get("outcome") == "failed" for r in mine[name])
        case_log, case_code = (log, code) if name == last else (own, int(fails))
        out.append(_tests_outcome(name, end - start, mine[name], case_log, case_code))
    rest = [name for name in names if name not in firsts]
    if rest and last is not None:  # the pytest ended before these: they get their own
        out += [case for group in groups(rest, opts) for case in run_group(group, opts, timeout)]
    else:  # it ran none of their tests (a usage or collection error): each says so
        out += [_tests_outcome(name, span[1] - span[0], [], log, code) for name in rest]
    return sorted(out, key=lambda case: names.index(case.name))


def _case_of(nodeid: str, names: list[str]) -> str | None:
    """Which of the cases ``names`` the test ``nodeid`` belongs to."""
    for name in names:
        for test in CASES[name].tests:
            if nodeid == test or nodeid.startswith((f"{test}::", f"{test}[")):
                return name
    return None


def _tests_outcome(
    name: str, seconds: float, records: list[dict], log: str, code: int
) -> CaseResult:
    """The case's rows from its tests' records (tests/gpu/conftest.py): one per test, its
    verdict pass, FAIL or why it skipped (``CUDA only``, ``needs 2 GPUs``)."""
    out = CaseResult(name, seconds, log=log)
    decided: dict[str, dict] = {}  # a test's call, or the setup or teardown that failed it
    for r in records:
        if not r.get("started") and (r["nodeid"] not in decided or r["outcome"] == "failed"):
            decided[r["nodeid"]] = r
    for r in decided.values():
        props = dict(r["properties"])
        verdict = {"passed": "pass", "failed": FAIL}.get(r["outcome"], r["reason"])
        measured = props.get("measured") or (f"raised {r['reason']}" if r["reason"] else "-")
        check = props.get("check", r["nodeid"].split("::")[-1])
        out.rows.append([check, verdict, measured, props.get("criterion", "-")])
        out.notes += [v for k, v in r["properties"] if k == "note" and v not in out.notes]
    starts = [r for r in records if r.get("started")]
    if TIMED_OUT in log:  # pytest-timeout ended the pytest in the last test it started
        out.problem = f"timed out after {starts[-1]['timeout'] if starts else 0:.0f} s"
    elif code < 0:
        out.problem = f"timed out after {BACKSTOP_S:.0f} s" if seconds >= BACKSTOP_S else None
        out.problem = out.problem or f"crashed (exit {code})"
    elif code not in (0, 1) or (code == 1 and not any(row[1] == FAIL for row in out.rows)):
        out.problem = f"crashed (exit {code})"
    return out


# ---- the report ----------------------------------------------------------------------------------


def environment(opts: GpuOptions) -> list[str]:
    lines = [f"- torch {torch.__version__}, CUDA {torch.version.cuda}"]
    if opts.dry:
        return [*lines, "- dry run: CPU stand-ins, tiny sizes (nothing here is a GPU result)"]
    lines.append(f"- {'quick' if opts.quick else 'full'} sizes")
    for i in range(opts.gpus):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"- cuda:{i}: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    return lines


def section(case: CaseResult) -> str:
    """A case as markdown: its heading, table and notes; the log when it failed."""
    title = CASES[case.name].proves if case.name in CASES else case.name
    lines = [f"## {case.name}: {case.verdict} ({case.seconds:.1f} s)", "", title, ""]
    if case.rows:
        lines += ["| check | verdict | measured | criterion |", "|---|---|---|---|"]
        lines += [
            "| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in case.rows
        ]
        lines += [""] + [f"- {note}" for note in case.notes]
    if case.problem is not None or (case.failed and case.log.strip()):
        what = f"**{case.problem}**; the" if case.problem else "The"
        lines += [f"{what} output (last 200 lines):", "", "```"]
        lines += case.log.rstrip().splitlines()[-200:] + ["```"]
    return "\n".join(lines) + "\n"


def summary(cases: list[CaseResult], elapsed: float, budget: float | None) -> str:
    lines = ["## Summary", "", "| case | result | seconds |", "|---|---|---|"]
    lines += [f"| {c.name} | {c.verdict} | {c.seconds:.1f} |" for c in cases]
    failures = [f for c in cases for f in c.failed]
    lines += ["", f"Failures: {len(failures)}"] + [f"- {f}" for f in failures]
    total = f"Total: {elapsed:.0f} s"
    if budget is not None:
        total += f" (budget {budget:.0f} s: {'within' if elapsed <= budget else 'OVER'})"
    return "\n".join([*lines, "", total]) + "\n"


# ---- the command -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        for name, case in CASES.items():
            print(f"{name:20} {case.proves}")
        return 0
    unknown = sorted(set(args.only or []) - set(CASES))
    if unknown:
        print(f"unknown case(s) {unknown}; see --list", file=sys.stderr)
        return 2
    gpus = 0 if args.cpu_dry_run else torch.cuda.device_count()
    if not args.cpu_dry_run and gpus == 0:
        print("no CUDA device: run with --cpu-dry-run", file=sys.stderr)
        return 2
    try:
        bands = gpu_bands.load(args.bands)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    opts = GpuOptions(dry=args.cpu_dry_run, quick=args.quick, gpus=gpus, inject=args.inject)
    where = gpu_bands.setting(opts)
    command = shlex.join(["python", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])])
    head = [f"# GPU check, {datetime.datetime.now():%Y-%m-%d %H:%M}", "", f"`{command}`", ""]
    report = ["\n".join(head + environment(opts)) + "\n"]
    print(report[0], flush=True)
    started, cases = time.perf_counter(), []
    for group in groups(args.only or list(CASES), opts):
        for result in run_group(group, opts, args.timeout):
            gpu_bands.judge(result, bands.get(where, {}))
            cases.append(result)
            report.append(section(result))
            print(report[-1], flush=True)
    budget = None if opts.dry else BUDGET_S["quick" if opts.quick else "full"]
    report.append(summary(cases, time.perf_counter() - started, budget))
    path = None if args.out is None else report_path(args.out, opts)
    report.append(gpu_bands.proposals(cases, where, path.name if path else head[0][2:]))
    print("\n".join(report[-2:]), flush=True)
    if path is not None:
        write(path, "\n".join(report))
    return 1 if any(c.failed for c in cases) else 0


def report_path(directory: Path, opts: GpuOptions) -> Path:
    """Where the report goes: ``DIR/gpu_check_<date>_<time>_<mode>.md``."""
    mode = "dry" if opts.dry else "quick" if opts.quick else "full"
    return directory / f"gpu_check_{datetime.datetime.now():%Y-%m-%d_%H%M}_{mode}.md"


def write(path: Path, text: str) -> Path:
    """The report at ``path`` (its folder made if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    sys.exit(main())
