"""Training tokens/s of a 12-layer Transformer on CPU: the plain model, K=1 and K=2 pipelines.

    python recipes/transformer_cpu_throughput.py            # ~2 min of CPU time (2 cores)
    python recipes/transformer_cpu_throughput.py --quick    # seconds (a smoke test)

Model: T(6, 1024, 4) with model dimension 256 (6 encoder + 6 decoder layers = 12 Transformer
layers, 14 children), on real variable-length batches of the generated multilingual corpus
(``data=translation``: token-bucketed, at most --max-tokens padded tokens, so every step has
other shapes). One step = forward + backward + Adam, the runner's loss (label-smoothed
cross-entropy summed over non-pad target tokens, divided by their count). tokens/s counts
non-pad target tokens, as the runner's ``train/tokens_per_s``.

    plain   the un-pipelined model, all intra-op threads
    K=1     GPipe, one stage, M micro-batches (micro-batching cost alone)
    K=2     GPipe, two CPU stand-in stages balanced by parameters, M micro-batches; each stage
            gets half of the threads (the engine's default for CPU stand-ins); re-materialization
            ``except_last`` (the runner's CPU default) and ``never`` (what recomputing costs)

The machine is shared and noisy: setups run in interleaved rounds, each round a few timed steps
after warm-up, and the table reports the median round (min and max alongside).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
from torch import nn

from giantpipe import GPipe  # noqa: E402
from giantpipe.data.bundle import Batch  # noqa: E402
from giantpipe.data.translation.bundle import translation  # noqa: E402
from giantpipe.perf.balance import balance_by_params  # noqa: E402
from giantpipe.runner.losses import build_loss  # noqa: E402
from models.transformer import transformer_t  # noqa: E402

Step = Callable[[Batch], None]


@dataclass(frozen=True)
class Setup:
    layers: int  # L of T(L, H, A): 2L Transformer layers
    d_model: int
    ffn_dim: int
    heads: int
    max_tokens: int
    chunks: int
    rounds: int
    steps: int
    warmup: int


FULL = Setup(layers=6, d_model=256, ffn_dim=1024, heads=4, max_tokens=1024, chunks=4, rounds=3,
             steps=3, warmup=1)  # fmt: skip
QUICK = Setup(layers=1, d_model=32, ffn_dim=64, heads=2, max_tokens=256, chunks=2, rounds=1,
              steps=1, warmup=1)  # fmt: skip


def batches(setup: Setup, count: int) -> list[Batch]:
    """The first ``count`` training batches of the generated corpus (also fixes the vocabulary)."""
    with tempfile.TemporaryDirectory() as work:
        bundle = translation(
            vocab_size=512, max_len=64, max_tokens=setup.max_tokens,
            min_sentences=setup.chunks, bleu_sentences=0, run_dir=work,
        )  # fmt: skip
        stream = bundle.train_batches(0, 0)
        return [next(stream) for _ in range(count)]


def model(setup: Setup) -> nn.Sequential:
    torch.manual_seed(0)
    return transformer_t(
        setup.layers, setup.ffn_dim, setup.heads, d_model=setup.d_model,
        head_dim=setup.d_model // setup.heads, vocab_size=512, max_len=64, dropout=0.1,
    )  # fmt: skip


def target_tokens(targets: torch.Tensor) -> float:
    return float(targets.ne(0).sum())


def plain_step(net: nn.Sequential) -> Step:
    loss_fn = build_loss("cross_entropy", 0.1, 0, summed=True)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)

    def step(batch: Batch) -> None:
        inputs, targets = batch
        assert isinstance(targets, torch.Tensor)
        loss = loss_fn(net(inputs), targets) / target_tokens(targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def pipe_step(net: nn.Sequential, stages: int, chunks: int, recompute: str = "except_last") -> Step:
    balance = balance_by_params(stages, net) if stages > 1 else [len(net)]
    pipe = GPipe(net, balance, devices=["cpu"] * stages, chunks=chunks, recompute=recompute)
    loss_fn = build_loss("cross_entropy", 0.1, 0, summed=True)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)

    def step(batch: Batch) -> None:
        inputs, targets = batch
        pipe.train_step(inputs, targets, loss_fn, loss_normalizer=target_tokens)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed_round(step: Step, data: list[Batch], setup: Setup) -> float:
    """tokens/s over ``setup.steps`` steps after ``setup.warmup`` untimed ones."""
    for batch in data[: setup.warmup]:
        step(batch)
    timed = data[setup.warmup : setup.warmup + setup.steps]
    start = time.perf_counter()
    for batch in timed:
        step(batch)
    elapsed = time.perf_counter() - start
    return sum(target_tokens(t) for _, t in timed) / elapsed  # type: ignore[arg-type]


def measure(setup: Setup) -> dict[str, list[float]]:
    data = batches(setup, setup.warmup + setup.steps)
    base = model(setup)
    steps = {
        "plain": plain_step(copy.deepcopy(base)),
        f"K=1, M={setup.chunks}": pipe_step(copy.deepcopy(base), 1, setup.chunks),
        f"K=2, M={setup.chunks}": pipe_step(copy.deepcopy(base), 2, setup.chunks),
        f"K=2, M={setup.chunks}, never": pipe_step(copy.deepcopy(base), 2, setup.chunks, "never"),
    }
    results: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(setup.rounds):  # interleaved, so load changes hit every setup alike
        for name, step in steps.items():
            results[name].append(timed_round(step, data, setup))
    return results


def table(results: dict[str, list[float]], setup: Setup) -> str:
    plain = statistics.median(results["plain"])
    lines = [
        f"T({setup.layers}, {setup.ffn_dim}, {setup.heads}), d_model {setup.d_model}, "
        f"<= {setup.max_tokens} tokens per batch, {torch.get_num_threads()} threads, "
        f"median of {setup.rounds} rounds x {setup.steps} steps",
        "",
        "| setup | tokens/s (median) | min | max | vs plain |",
        "|---|---|---|---|---|",
    ]
    for name, values in results.items():
        median = statistics.median(values)
        lines.append(
            f"| {name} | {median:.0f} | {min(values):.0f} | {max(values):.0f} | "
            f"{median / plain:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse()
    setup = QUICK if args.quick else FULL
    if args.rounds:
        setup = Setup(**{**setup.__dict__, "rounds": args.rounds})
    print(table(measure(setup), setup))


if __name__ == "__main__":
    main()
