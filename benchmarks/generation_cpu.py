"""Generation on CPU: tokens/s and peak memory of cached, pipelined decoding against today's
uncached decoder, on a 12-layer decoder-only Transformer (models/transformer_lm.py).

    python benchmarks/generation_cpu.py            # output lengths 32, 128, 512: ~15 min idle
    python benchmarks/generation_cpu.py --quick    # lengths 32 and 128, fewer pipes: minutes
    python benchmarks/generation_cpu.py --lengths 512 --pipes 2,1 2,2 --no-hf --out OUT
    python benchmarks/generation_cpu.py --d-model 256 --rows 32 --skip-uncached ...  # wider

Every case decodes the same prompts (ROWS prompts of 8 tokens, greedy, no </s>: every row makes
exactly L tokens) with the same random weights, in a process of its own (forked): the model and
pipe built, one warm-up call (16 tokens, untimed), then ``--rounds`` timed calls. It reports the
median tokens per second of the rounds (and their range), and the peak resident memory a call
adds (VmHWM over the RSS at the call's start, the mark reset before each call; the largest of
the rounds). The two Hugging Face cases run in one process, their rounds alternating, so that
both see the same machine: their ratio is the median of the rounds' ratios.

    plain, no cache    today's decoder: the whole prefix through every layer at every position
    plain, cache       engine.generate on the plain Sequential (one stage, the caller's thread)
    gp K=k M=m         engine.generate through GPipe: k stages on CPU stand-ins (a worker
                       thread each), the rows cut into m micro-batches
    gp K=2 V=2 M=2     the same with the interleaved schedule's placement: 4 stages on 2
                       workers (stage s on worker s % 2), each worker keeping 2 stages' caches:
                       a token's step goes round the workers twice
    hf generate        transformers' GPT-2 of the same shape, generate() with its cache (a peer)
    hf gp K=2 M=1      that GPT-2 captured by sequentialize, its pieces given caches
                       (models.hf.give_caches), through GPipe
                       (both: transformers' import, the model's init and the capture not counted)

The cached cases' tokens are checked against the uncached decoder's where both ran (every
round gives the same tokens). Below the table: the cached decoder's speed-up over the uncached
one per length, pipelining's M >= 2 over M = 1, giantpipe's K=2 over Hugging Face's generate on
the same GPT-2, and what stage 0 holds (its share of the weights and of the caches) for each K.
Writes ``OUT.md`` (table, date, command, the load average before and after) and ``OUT.png``
(tokens/s against output length).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.testing.outputs import add_output_options, output_path  # noqa: E402

LAYERS, D_MODEL, HEADS, VOCAB, ROWS, PROMPT = 12, 64, 4, 1000, 8, 8
ROUNDS = 5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lengths 32 and 128, fewer pipes")
    add_output_options(parser, "generation_cpu")  # OUT.md and OUT.png
    parser.add_argument("--no-hf", action="store_true", help="leave out the Hugging Face peer")
    parser.add_argument("--lengths", type=int, nargs="+", help="output lengths (overrides)")
    parser.add_argument("--pipes", nargs="+", help="K,M pairs, e.g. 2,1 2,2 (overrides)")
    parser.add_argument("--d-model", type=int, default=D_MODEL, help="model width (FFN 4x)")
    parser.add_argument("--rows", type=int, default=ROWS, help="prompts decoded at once")
    parser.add_argument("--skip-uncached", action="store_true", help="cached cases only")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed calls per case")
    parser.add_argument("--note", default="", help="a line for OUT.md (what the run replaces)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
from torch import nn

from giantpipe import GPipe  # noqa: E402
from giantpipe.engine.generate import Decoding, generate, split_rows  # noqa: E402
from giantpipe.perf.balance import even_balance  # noqa: E402
from models.transformer import transformer_lm  # noqa: E402

HF_PIPE = "hf gp K=2 M=1"


def build(length: int) -> nn.Sequential:
    torch.manual_seed(0)
    model = transformer_lm(
        LAYERS, d_model=D_MODEL, ffn_dim=4 * D_MODEL, num_heads=HEADS, vocab_size=VOCAB,
        max_len=PROMPT + length,
    )  # fmt: skip
    return model.eval()


def prompts() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, PROMPT), generator=torch.Generator().manual_seed(1))


Decode = Callable[[int], list[list[int]]]
"""A case, built: ``decode(n)`` makes n new tokens per row (what is timed)."""
HF_CASE = "hf generate"
WARM_UP = 16  # tokens of the untimed first call: kernels, thread pools and caches warmed


@torch.no_grad()
def uncached(model: nn.Sequential, x: torch.Tensor, length: int) -> list[list[int]]:
    seq = x
    for _ in range(length):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, PROMPT:].tolist()


def hf_gpt2(length: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=PROMPT + length, n_embd=D_MODEL, n_layer=LAYERS,
        n_head=HEADS, n_inner=4 * D_MODEL, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,  # inside the vocabulary (GPT-2's own 50256 is not)
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def hf_generate(length: int, x: torch.Tensor) -> Decode:
    model = hf_gpt2(length)

    def decode(n: int) -> list[list[int]]:
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, use_cache=True, pad_token_id=0,
        )  # fmt: skip
        return out[:, PROMPT:].tolist()

    return decode


def hf_pipe(length: int, x: torch.Tensor) -> Decode:
    from giantpipe import sequentialize
    from models.hf import give_caches

    model = hf_gpt2(length)
    seq = sequentialize(model, x, output="logits")
    give_caches(model, list(seq), seq.spans)
    pipe = GPipe(
        seq, even_balance(len(seq), 2), devices=["cpu"] * 2, chunks=1, threads_per_worker=1
    )

    def decode(n: int) -> list[list[int]]:
        out = generate(pipe, [x], [n], Decoding())
        return [row for chunk in out for row in chunk]

    return decode


def prepare(case: str, length: int) -> Decode:
    """The case built (model, capture, pipe: not timed); its decode call."""
    x = prompts()
    if case == HF_CASE:
        return hf_generate(length, x)
    if case == HF_PIPE:
        return hf_pipe(length, x)
    model = build(length)
    if case == "plain, no cache":
        return lambda n: uncached(model, x, n)
    if case == "plain, cache":
        return lambda n: generate(model, [x], [n], Decoding())[0]
    knobs = {part.split("=")[0]: int(part.split("=")[1]) for part in case.split()[1:]}
    k, v, m = knobs["K"], knobs.get("V", 1), knobs["M"]
    balance = even_balance(len(model), k * v)
    schedule = "interleaved" if v > 1 else "gpipe"
    pipe = GPipe(
        model, balance, devices=["cpu"] * k, chunks=m, threads_per_worker=1, schedule=schedule,
        virtual_stages=v if v > 1 else None,
    )  # fmt: skip

    def decode(n: int) -> list[list[int]]:
        out = generate(pipe, split_rows(x, m), [n] * m, Decoding())
        return [row for chunk in out for row in chunk]

    return decode


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Resets the process's peak RSS mark (VmHWM); False where the kernel does not let it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _round(decode: Decode, length: int) -> tuple[list[list[int]], float, float, float]:
    """One timed call: (tokens, seconds, CPU seconds of all the process's threads, peak MB it
    added)."""
    _reset_peak()
    start_rss = _status_kb("VmRSS")
    began, cpu = time.perf_counter(), time.process_time()
    tokens = decode(length)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    return tokens, seconds, cpu, (_status_kb("VmHWM") - start_rss) / 1024


def _child(cases: list[str], length: int, rounds: int, queue: Any) -> None:
    """``cases`` built, warmed up, then ``rounds`` rounds of each, alternating between them."""
    torch.set_num_threads(1)
    try:
        decodes = {case: prepare(case, length) for case in cases}
        for decode in decodes.values():
            decode(min(length, WARM_UP))
        seen = {c: {"seconds": [], "cpu_s": [], "peak_mb": 0.0} for c in cases}
        for _ in range(rounds):
            for case, decode in decodes.items():
                tokens, seconds, cpu, peak = _round(decode, length)
                record: dict[str, Any] = seen[case]
                record["same_rounds"] = record.get("tokens", tokens) == tokens
                record["tokens"], record["peak_mb"] = tokens, max(record["peak_mb"], peak)
                record["seconds"].append(seconds)
                record["cpu_s"].append(cpu)
        queue.put(seen)
    except Exception as err:  # noqa: BLE001 - a peer's failure is a row of the table
        queue.put({case: {"error": f"{type(err).__name__}: {err}"} for case in cases})


def measure(cases: list[str], length: int, rounds: int) -> dict[str, dict[str, Any]]:
    """``cases`` in a forked process of their own: a fresh process, nothing shared."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(cases, length, rounds, queue))
    proc.start()
    result: dict[str, dict[str, Any]] = queue.get(timeout=3600)
    proc.join()
    for record in result.values():
        if "seconds" in record:
            record["median_s"] = statistics.median(record["seconds"])
            record["median_cpu_s"] = statistics.median(record["cpu_s"])
    return result


def speed(record: dict[str, Any], n: int, seconds: float | None = None) -> float:
    """Tokens per second of a case's median round (or of ``seconds``)."""
    return ROWS * n / (record["median_s"] if seconds is None else seconds)


def stage0_share(k: int, length: int) -> tuple[float, float, float]:
    """(stage 0's weights MB, its share of the weights, its caches' MB at the end) for K=k."""
    model = build(length)
    first = even_balance(len(model), k)[0]
    total = sum(p.numel() for p in model.parameters())
    mine = sum(p.numel() for layer in list(model)[:first] for p in layer.parameters())
    layers = first - 1  # child 0 is the embedding: no cache
    cache = layers * 2 * ROWS * (PROMPT + length) * D_MODEL * 4
    return mine * 4 / 2**20, mine / total, cache / 2**20


def load() -> str:
    """The 1-minute load average (a shared machine's figures compare only within one run)."""
    return f"{os.getloadavg()[0]:.2f}"


def main() -> None:
    global D_MODEL, ROWS  # set from the options, read by the forked cases
    args = parse()
    D_MODEL, ROWS = args.d_model, args.rows
    lengths = args.lengths or ([32, 128] if args.quick else [32, 128, 512])
    pipes = [(2, 1), (2, 2), (4, 1), (4, 4)] if args.quick else [
        (k, m) for k in (2, 4) for m in (1, 2, 4)
    ]  # fmt: skip
    if args.pipes:
        pipes = [(int(k), int(m)) for k, m in (p.split(",") for p in args.pipes)]
    cases = ["plain, no cache", "plain, cache", *[f"gp K={k} M={m}" for k, m in pipes]]
    cases.append("gp K=2 V=2 M=2")  # virtual stages: interleaved placement
    if args.skip_uncached:
        cases.remove("plain, no cache")
    groups = [[case] for case in cases]
    if not args.no_hf:
        groups.append([HF_CASE, HF_PIPE])  # one process, rounds alternating: side by side
        cases += [HF_CASE, HF_PIPE]
    before = load()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for length in lengths:
        for group in groups:
            for case, record in measure(group, length, args.rounds).items():
                results[case, length] = record
                shown = f"{speed(record, length):9.1f}" if "median_s" in record else "failed"
                print(f"L={length:4d} {case:16s} {shown} tok/s (median)", flush=True)
    command = " ".join(f'"{a}"' if a == args.note else a for a in sys.argv)
    if args.note:  # the note is in the file already: the command names it only
        command = command.replace(f'"{args.note}"', '"..."')
    report = render(results, cases, lengths, pipes, command, args.rounds, (before, load()))
    if args.note:
        report = report.replace("\nModel:", f"\n{args.note}\nModel:", 1)
    out = output_path(args, ROOT, "generation_cpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report)
    plot(results, cases, lengths, out.with_suffix(".png"))
    print(report)


def _same(
    results: dict[tuple[str, int], dict[str, Any]], case: str, n: int, record: dict[str, Any]
) -> bool | None:
    """Whether ``case`` gave the reference's tokens at length n (and the same every round)."""
    ref = results.get(("plain, no cache", n), results.get(("plain, cache", n), {})).get("tokens")
    if case == HF_PIPE:  # the same GPT-2 as hf generate's
        ref = results.get((HF_CASE, n), {}).get("tokens")
    if case == HF_CASE or ref is None:
        return None
    return record["tokens"] == ref and record["same_rounds"]


def _hf_ratio(results: dict[tuple[str, int], dict[str, Any]], n: int) -> str | None:
    """giantpipe's K=2 over HF's generate, round by round (the rounds alternate), in tokens
    per second and per CPU second."""
    hf, gp = results.get((HF_CASE, n), {}), results.get((HF_PIPE, n), {})
    if "seconds" not in hf or "seconds" not in gp:
        return None
    shown = []
    for key, what in (("seconds", "tok/s"), ("cpu_s", "tok/CPU-s")):
        ratios = sorted(h / g for h, g in zip(hf[key], gp[key], strict=True))
        middle = statistics.median(ratios)
        shown.append(f"{middle:.2f}x in {what} (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x)")
    return f"- L={n}: hf gp K=2 M=1 / hf generate: " + ", ".join(shown)


def render(
    results: dict[tuple[str, int], dict[str, Any]],
    cases: list[str],
    lengths: list[int],
    pipes: list[tuple[int, int]],
    command: str,
    rounds: int,
    loads: tuple[str, str],
) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Generation on CPU: cached, pipelined decoding against the uncached decoder",
        "",
        f"Measured {date} with `python {command}` on {platform.machine()} "
        f"({os.cpu_count()} cores), torch {torch.__version__}, 1 intra-op thread per worker; "
        f"load average (1 min) {loads[0]} before, {loads[1]} after.",
        f"Each case: built, warmed up ({WARM_UP} tokens), then {rounds} timed rounds in a process "
        "of its own (the two HF cases in one, alternating); tok/s is the median round's, with "
        "the rounds' range; tok/CPU-s divides by the CPU time of all the process's threads "
        "(less sensitive to a busy machine); peak MB the most a round added to the resident "
        "memory.",
        f"Model: transformer_lm({LAYERS}), d_model {D_MODEL}, {HEADS} heads, FFN {4 * D_MODEL}, "
        f"vocabulary {VOCAB}; {ROWS} prompts of {PROMPT} tokens, greedy, L new tokens each.",
        "",
        "| case | "
        + " | ".join(f"L={n} tok/s (range) | L={n} tok/CPU-s | L={n} peak MB" for n in lengths)
        + " | same tokens |",
        "|---|" + "---|---|---|" * len(lengths) + "---|",
    ]
    for case in cases:
        cells, same = [], []
        for n in lengths:
            r = results[case, n]
            if "error" in r:
                cells += [r["error"][:60], "-", "-"]
                continue
            low, high = (speed(r, n, s) for s in (max(r["seconds"]), min(r["seconds"])))
            per_cpu = speed(r, n, r["median_cpu_s"])
            cells += [f"{speed(r, n):.0f} ({low:.0f}-{high:.0f})", f"{per_cpu:.0f}"]
            cells.append(f"{r['peak_mb']:.1f}")
            same.append(_same(results, case, n, r))
        checked = [s for s in same if s is not None]
        shown = "n/a (other weights)" if case == HF_CASE else str(all(checked) and bool(checked))
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {shown} |")
    lines += ["", "Ratios (median tokens/s):", ""]
    for n in lengths:
        base, cached = results.get(("plain, no cache", n), {}), results["plain, cache", n]
        if "median_s" in base and "median_s" in cached:
            ratio = base["median_s"] / cached["median_s"]
            lines.append(f"- L={n}: plain with cache / without: {ratio:.2f}x")
        for k in sorted({k for k, _ in pipes}):
            one = results.get((f"gp K={k} M=1", n), {})
            for m in sorted({m for kk, m in pipes if kk == k and m > 1}):
                more = results.get((f"gp K={k} M={m}", n), {})
                if "median_s" in one and "median_s" in more:
                    ratio = one["median_s"] / more["median_s"]
                    lines.append(f"- L={n}: K={k} M={m} / K={k} M=1: {ratio:.2f}x")
        if (hf := _hf_ratio(results, n)) is not None:
            lines.append(hf)
    lines += ["", "What stage 0 holds (one process per stage under torchrun):", ""]
    for k in sorted({k for k, _ in pipes}):
        for n in lengths:
            mb, share, cache = stage0_share(k, n)
            lines.append(
                f"- K={k}, L={n}: weights {mb:.2f} MB ({share:.0%} of the model), "
                f"caches {cache:.2f} MB at the end"
            )
    return "\n".join(lines) + "\n"


def plot(
    results: dict[tuple[str, int], dict[str, Any]], cases: list[str], lengths: list[int], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for case in cases:
        points = [
            (n, speed(results[case, n], n)) for n in lengths if "median_s" in results[case, n]
        ]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=case)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("output length L (tokens per row)")
    ax.set_ylabel("generated tokens / s (median round)")
    ax.set_title(f"transformer_lm({LAYERS}), {ROWS} rows, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
