"""Generation on CPU: tokens/s and peak memory of cached, pipelined decoding against today's
uncached decoder, on a 12-layer decoder-only Transformer (models/transformer_lm.py).

    python benchmarks/generation_cpu.py            # output lengths 32, 128, 512: ~15 min idle
    python benchmarks/generation_cpu.py --quick    # lengths 32 and 128, fewer pipes: minutes
    python benchmarks/generation_cpu.py --lengths 512 --pipes 2,1 2,2 --no-hf --out OUT
    python benchmarks/generation_cpu.py --d-model 256 --rows 32 --skip-uncached ...  # wider

Every case decodes the same prompts (ROWS prompts of 8 tokens, greedy, no </s>: every row makes
exactly L tokens) with the same random weights, in a process of its own (forked), and reports
generated tokens per second and the growth of the process's peak resident memory (VmHWM over
the RSS it started with):

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

The cached cases' tokens are checked against the uncached decoder's where both ran. Below the
table: the cached decoder's speed-up over the uncached one per length, pipelining's M >= 2 over
M = 1, and what stage 0 holds (its share of the weights and of the caches) for each K.
Writes ``OUT.md`` (table, date, command) and ``OUT.png`` (tokens/s against output length).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe import GPipe  # noqa: E402
from giantpipe.engine.generate import Decoding, generate, split_rows  # noqa: E402
from giantpipe.perf.balance import even_balance  # noqa: E402
from giantpipe.testing.outputs import add_output_options, output_path  # noqa: E402
from models.transformer import transformer_lm  # noqa: E402

LAYERS, D_MODEL, HEADS, VOCAB, ROWS, PROMPT = 12, 64, 4, 1000, 8, 8
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


@torch.no_grad()
def uncached(model: nn.Sequential, x: torch.Tensor, length: int) -> list[list[int]]:
    seq = x
    for _ in range(length):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, PROMPT:].tolist()


SETUP_S = 0.0  # a case's preparation not to count as decoding (the HF pipe's capture)


def hf_gpt2(length: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=PROMPT + length, n_embd=D_MODEL, n_layer=LAYERS,
        n_head=HEADS, n_inner=4 * D_MODEL, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,  # inside the vocabulary (GPT-2's own 50256 is not)
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def hf_generate(length: int, x: torch.Tensor) -> list[list[int]]:
    global SETUP_S
    began = time.perf_counter()
    model = hf_gpt2(length)  # transformers' import and the model's init: not decoding
    SETUP_S = time.perf_counter() - began
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=length, min_new_tokens=length,
        do_sample=False, use_cache=True, pad_token_id=0,
    )  # fmt: skip
    return out[:, PROMPT:].tolist()


def hf_pipe(length: int, x: torch.Tensor) -> list[list[int]]:
    global SETUP_S
    from giantpipe import sequentialize
    from models.hf import give_caches

    began = time.perf_counter()
    model = hf_gpt2(length)
    seq = sequentialize(model, x, output="logits")
    give_caches(model, list(seq), seq.spans)
    pipe = GPipe(
        seq, even_balance(len(seq), 2), devices=["cpu"] * 2, chunks=1, threads_per_worker=1
    )
    SETUP_S = time.perf_counter() - began
    out = generate(pipe, [x], [length], Decoding())
    pipe.close()
    return [row for chunk in out for row in chunk]


def run_case(case: str, length: int) -> list[list[int]]:
    x = prompts()
    if case == "hf generate":
        return hf_generate(length, x)
    if case == HF_PIPE:
        return hf_pipe(length, x)
    model = build(length)
    if case == "plain, no cache":
        return uncached(model, x, length)
    if case == "plain, cache":
        return generate(model, [x], [length], Decoding())[0]
    knobs = {part.split("=")[0]: int(part.split("=")[1]) for part in case.split()[1:]}
    k, v, m = knobs["K"], knobs.get("V", 1), knobs["M"]
    balance = even_balance(len(model), k * v)
    schedule = "interleaved" if v > 1 else "gpipe"
    pipe = GPipe(
        model, balance, devices=["cpu"] * k, chunks=m, threads_per_worker=1, schedule=schedule,
        virtual_stages=v if v > 1 else None,
    )  # fmt: skip
    out = generate(pipe, split_rows(x, m), [length] * m, Decoding())
    pipe.close()
    return [row for chunk in out for row in chunk]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _child(case: str, length: int, queue: Any) -> None:
    torch.set_num_threads(1)
    start_rss = _status_kb("VmRSS")
    began = time.perf_counter()
    try:
        tokens = run_case(case, length)
        elapsed = time.perf_counter() - began - SETUP_S
        peak_mb = (_status_kb("VmHWM") - start_rss) / 1024
        queue.put({"tokens": tokens, "seconds": elapsed, "peak_mb": peak_mb})
    except Exception as err:  # noqa: BLE001 - a peer's failure is a row of the table
        queue.put({"error": f"{type(err).__name__}: {err}"})


def measure(case: str, length: int) -> dict[str, Any]:
    """One case in a forked process of its own: a fresh peak-memory mark."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(case, length, queue))
    proc.start()
    result: dict[str, Any] = queue.get(timeout=3600)
    proc.join()
    return result


def stage0_share(k: int, length: int) -> tuple[float, float, float]:
    """(stage 0's weights MB, its share of the weights, its caches' MB at the end) for K=k."""
    model = build(length)
    first = even_balance(len(model), k)[0]
    total = sum(p.numel() for p in model.parameters())
    mine = sum(p.numel() for layer in list(model)[:first] for p in layer.parameters())
    layers = first - 1  # child 0 is the embedding: no cache
    cache = layers * 2 * ROWS * (PROMPT + length) * D_MODEL * 4
    return mine * 4 / 2**20, mine / total, cache / 2**20


def main() -> None:
    global D_MODEL, ROWS  # set from the options, read by the forked cases
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lengths 32 and 128, fewer pipes")
    add_output_options(parser, "generation_cpu")  # OUT.md and OUT.png
    parser.add_argument("--no-hf", action="store_true", help="leave out the Hugging Face peer")
    parser.add_argument("--lengths", type=int, nargs="+", help="output lengths (overrides)")
    parser.add_argument("--pipes", nargs="+", help="K,M pairs, e.g. 2,1 2,2 (overrides)")
    parser.add_argument("--d-model", type=int, default=D_MODEL, help="model width (FFN 4x)")
    parser.add_argument("--rows", type=int, default=ROWS, help="prompts decoded at once")
    parser.add_argument("--skip-uncached", action="store_true", help="cached cases only")
    args = parser.parse_args()
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
    if not args.no_hf:
        cases += ["hf generate", HF_PIPE]
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for length in lengths:
        for case in cases:
            results[case, length] = measure(case, length)
            shown = results[case, length]
            speed = ROWS * length / shown["seconds"] if "seconds" in shown else float("nan")
            print(f"L={length:4d} {case:16s} {speed:9.1f} tok/s", flush=True)
    report = render(results, cases, lengths, pipes, " ".join(sys.argv))
    out = output_path(args, ROOT, "generation_cpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report)
    plot(results, cases, lengths, out.with_suffix(".png"))
    print(report)


def render(
    results: dict[tuple[str, int], dict[str, Any]],
    cases: list[str],
    lengths: list[int],
    pipes: list[tuple[int, int]],
    command: str,
) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Generation on CPU: cached, pipelined decoding against the uncached decoder",
        "",
        f"Measured {date} with `python {command}` on {platform.machine()}, "
        f"torch {torch.__version__}, 1 intra-op thread per worker.",
        f"Model: transformer_lm({LAYERS}), d_model {D_MODEL}, {HEADS} heads, FFN {4 * D_MODEL}, "
        f"vocabulary {VOCAB}; {ROWS} prompts of {PROMPT} tokens, greedy, L new tokens each.",
        "",
        "| case | "
        + " | ".join(f"L={n} tok/s | L={n} peak MB" for n in lengths)
        + " | same tokens |",
        "|---|" + "---|---|" * len(lengths) + "---|",
    ]
    for case in cases:
        cells, same = [], []
        for n in lengths:
            r = results[case, n]
            if "error" in r:
                cells += [r["error"][:60], "-"]
                continue
            cells += [f"{ROWS * n / r['seconds']:.0f}", f"{r['peak_mb']:.1f}"]
            ref = results.get(("plain, no cache", n), results["plain, cache", n]).get("tokens")
            if case == HF_PIPE:  # the same GPT-2 as hf generate's
                ref = results.get(("hf generate", n), {}).get("tokens")
            if case != "hf generate" and ref is not None:
                same.append(r["tokens"] == ref)
        shown = "n/a (other weights)" if case == "hf generate" else str(all(same))
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {shown} |")
    lines += ["", "Ratios (tokens/s):", ""]
    for n in lengths:
        base, cached = results.get(("plain, no cache", n), {}), results["plain, cache", n]
        if "seconds" in base and "seconds" in cached:
            lines.append(
                f"- L={n}: plain with cache / without: {base['seconds'] / cached['seconds']:.2f}x"
            )
        for k in sorted({k for k, _ in pipes}):
            one = results.get((f"gp K={k} M=1", n), {})
            for m in sorted({m for kk, m in pipes if kk == k and m > 1}):
                more = results.get((f"gp K={k} M={m}", n), {})
                if "seconds" in one and "seconds" in more:
                    ratio = one["seconds"] / more["seconds"]
                    lines.append(f"- L={n}: K={k} M={m} / K={k} M=1: {ratio:.2f}x")
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
            (n, ROWS * n / results[case, n]["seconds"])
            for n in lengths
            if "seconds" in results[case, n]
        ]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=case)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("output length L (tokens per row)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"transformer_lm({LAYERS}), {ROWS} rows, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
