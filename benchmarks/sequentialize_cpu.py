"""Bring your own model: a GPT-2-small-shaped Hugging Face model, pipelined by giantpipe and by
torch.distributed.pipelining's own tracer, side by side.

    python benchmarks/sequentialize_cpu.py            # GPT-2 small shape: ~15 min on 2 cores
    python benchmarks/sequentialize_cpu.py --quick    # a 2-layer GPT-2: a minute
    python benchmarks/sequentialize_cpu.py --untied   # tie_word_embeddings=False (pippy exact)

The same model (GPT2LMHeadModel from GPT2Config: 12 layers, width 768, 12 heads, 50257 tokens,
input and output embeddings tied; random weights, dropout off), the same batch and the same cut
(embeddings and the first half of the layers | the second half and the head), checkpoint
'never', K=2, M=8:

    gp-local-<s>   giantpipe.sequentialize + GPipe on 2 CPU stand-ins (one process, a worker
                   thread and a core per stage)
    gp-dist-<s>    giantpipe.sequentialize + DistributedPipe, 2 gloo processes, a core each
    pippy-<s>      torch.distributed.pipelining: pipeline() (its torch.export tracer, split_spec
                   at the same layer) + ScheduleGPipe / Schedule1F1B, 2 gloo processes

for the schedules s = gpipe and 1f1b. The even cut leaves the second stage the heavier one (the
head's matmul over 50257 tokens costs about five layers), so the last schedule runs once more at
the cut giantpipe chooses itself, ``balance_by_time`` over the pieces ``sequentialize`` cuts at
every layer (``-timed``), pippy included, at that same cut: one column compares engines at equal
cuts, the other what each user gets from the even cut pippy's users write by hand.

Everything runs in the same two processes, interleaved per
round (the local executor on rank 0 while rank 1 waits at a barrier); medians of the rounds.
Each method's first loss is compared with the plain model's on the same batch, so a pipeline
that runs but computes something else is caught; a peer's exception or wrong loss is listed
under the table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

SCHEDULES = ("gpipe", "1f1b")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer GPT-2, one round")
    parser.add_argument("--untied", action="store_true", help="tie_word_embeddings=False")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="e.g. gpipe")
    parser.add_argument("--rounds", type=int, help="rounds to take the median of")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from giantpipe import GPipe, sequentialize
from giantpipe.engine.distributed.pipe import DistributedPipe, end_distributed
from giantpipe.perf.balance import balance_by_time
from giantpipe.testing import free_port

TIED = ("wte.weight", "lm_head.weight")  # GPT-2's input and output embeddings: one parameter


@dataclass(frozen=True)
class Setup:
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int
    chunks: int
    rounds: int
    steps: int
    tied: bool = True
    schedules: tuple[str, ...] = SCHEDULES


FULL = Setup(layers=12, width=768, heads=12, vocab=50257, seq=32, batch=16, chunks=8, rounds=3,
             steps=1)  # fmt: skip
QUICK = Setup(layers=2, width=64, heads=4, vocab=500, seq=16, batch=8, chunks=2, rounds=1,
              steps=1)  # fmt: skip


def gpt2(setup: Setup) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=setup.layers, n_embd=setup.width, n_head=setup.heads, vocab_size=setup.vocab,
        n_positions=max(64, setup.seq), bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=setup.tied,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def batch(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, setup.vocab, (setup.batch, setup.seq), generator=g)
    return ids, torch.randint(0, setup.vocab, (setup.batch, setup.seq), generator=g)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


# ---- the methods, as (step, first loss) built on each rank -----------------------------------


class Method:
    """One pipeline on this rank: ``step()`` runs a training step, returns the loss or None;
    ``tied()`` the embedding parameters this rank holds, by name (tied: one, or a copy per
    stage)."""

    def __init__(
        self, name: str, step: Callable[[], float | None], module: nn.Module | None
    ) -> None:
        self.name, self.step, self.module = name, step, module

    def tied(self) -> list[tuple[str, torch.Tensor]]:
        if self.module is None:
            return []
        named = self.module.state_dict(keep_vars=True).items()
        return [(n, t) for n, t in named if n.endswith(TIED)]


def even_balance(setup: Setup) -> list[int]:
    """The hand-written cut, before layer L/2 (pieces: embeddings, each layer, ln_f + head)."""
    half = setup.layers // 2
    return [1 + half, setup.layers - half + 1]


def timed_balance(setup: Setup, seq: nn.Sequential) -> list[int]:
    """giantpipe's own cut: ``balance_by_time`` over the pieces on one micro-batch, measured on
    rank 0 (two processes' timings would differ) and sent to rank 1."""
    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        ids, _ = batch(setup)
        choice[0] = balance_by_time(2, seq, ids[: setup.batch // setup.chunks])
    dist.broadcast_object_list(choice, src=0)
    return list(choice[0])


def cut_name(setup: Setup, balance: list[int]) -> str:
    """The submodule the second stage starts at, as pippy's split_spec names it."""
    first = balance[0]  # pieces in stage 0: the embeddings and first - 1 layers
    return f"transformer.h.{first - 1}" if first <= setup.layers else "transformer.ln_f"


def giantpipe_methods(
    setup: Setup, model: nn.Module, rank: int, timed: list[int] | None = None
) -> list[Method]:
    """Each schedule at the even cut; with ``timed``, the last schedule again at that cut."""
    ids, labels = batch(setup)
    seq = sequentialize(copy.deepcopy(model), ids[:2], output="logits")
    runs = [(s, even_balance(setup), "") for s in setup.schedules]
    if timed is not None:
        runs.append((setup.schedules[-1], timed, "-timed"))
    methods = []
    for schedule, balance, suffix in runs:
        local = None
        if rank == 0:  # rank 1 has the method too (an empty step): the lists stay in step
            local = GPipe(copy.deepcopy(seq), balance, devices=["cpu", "cpu"],
                          chunks=setup.chunks, checkpoint="never", schedule=schedule)  # fmt: skip

        def local_step(pipe: GPipe | None = local) -> float | None:
            if pipe is None:
                return None
            pipe.zero_grad(set_to_none=True)
            torch.set_num_threads(2)  # one core per stage
            try:
                return pipe.train_step(ids, labels, token_loss).item()
            finally:
                torch.set_num_threads(1)

        methods.append(Method(f"gp-local-{schedule}{suffix}", local_step, local))
        pipe = DistributedPipe(
            copy.deepcopy(seq), balance, chunks=setup.chunks, recompute="never",
            schedule=schedule, init=None, timeout=600,
        )  # fmt: skip

        def dist_step(pipe: DistributedPipe = pipe) -> float:
            pipe.zero_grad(set_to_none=True)
            x = ids if pipe.needs_inputs else None
            return pipe.train_step(x, labels if pipe.needs_targets else None, token_loss).item()

        methods.append(Method(f"gp-dist-{schedule}{suffix}", dist_step, pipe))
    return methods


def pippy_method(
    setup: Setup, model: nn.Module, rank: int, schedule: str, cut: str, suffix: str = ""
) -> Method:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        SplitPoint,
        pipeline,
    )

    ids, labels = batch(setup)
    micro = setup.batch // setup.chunks
    split = {cut: SplitPoint.BEGINNING}
    traced = pipeline(copy.deepcopy(model), mb_args=(ids[:micro],),
                      mb_kwargs={"use_cache": False}, split_spec=split)  # fmt: skip
    stage = traced.build_stage(rank, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out[0]
        return token_loss(logits, target)

    runner = cls(stage, n_microbatches=setup.chunks, loss_fn=loss_fn)

    def step() -> float | None:
        stage.submod.zero_grad(set_to_none=True)
        if rank == 0:
            runner.step(ids)
            return None
        losses: list[torch.Tensor] = []
        runner.step(target=labels, losses=losses)
        return float(torch.stack(losses).detach().mean())

    return Method(f"pippy-{schedule}{suffix}", step, stage.submod)


# ---- one pair of processes: build everything, then interleaved rounds ----------------------


def agree(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def build(
    setup: Setup, model: nn.Module, rank: int, failures: dict[str, str], timed: list[int]
) -> list[Method]:
    """Every method that builds on both ranks; a failure is recorded, the method dropped.
    ``timed``: giantpipe's own cut, where both sides run the last schedule once more."""
    methods: list[Method] = []
    builders: list[tuple[str, Callable[[], list[Method]]]] = [
        ("giantpipe", lambda: giantpipe_methods(setup, model, rank, timed))
    ]
    even = cut_name(setup, even_balance(setup))
    runs = [(s, even, "") for s in setup.schedules]
    runs.append((setup.schedules[-1], cut_name(setup, timed), "-timed"))
    for schedule, cut, suffix in runs:
        builders.append(
            (
                f"pippy-{schedule}{suffix}",
                lambda s=schedule, c=cut, x=suffix: [pippy_method(setup, model, rank, s, c, x)],
            )
        )
    for name, make in builders:
        try:
            made, ok = make(), True
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a result
            made, ok = [], False
            failures[name] = f"build: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
        if agree(ok):
            methods += made
        else:
            failures.setdefault(name, "build failed on the other rank")
    return methods


def run_step(method: Method, rank: int) -> float | None:
    """One step on both ranks (the local executor's is empty on rank 1); its loss if known."""
    return method.step()


def _worker(rank: int, port: int, setup: Setup, out_path: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=900)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout
    )
    model = gpt2(setup)
    ids, labels = batch(setup)
    plain = copy.deepcopy(model)
    loss = token_loss(plain(ids, use_cache=False).logits, labels)
    loss.backward()
    reference = loss.item()
    tied_grad = {"wte.weight": plain.transformer.wte.weight.grad,
                 "lm_head.weight": plain.lm_head.weight.grad}  # fmt: skip
    del plain, loss
    failures: dict[str, str] = {}
    ids_example = batch(setup)[0][:2]
    timed = timed_balance(setup, sequentialize(copy.deepcopy(model), ids_example, output="logits"))
    methods = build(setup, model, rank, failures, timed)
    first: dict[str, float | None] = {}
    tied_error: dict[str, float] = {}
    rounds: list[dict[str, float]] = []
    for r in range(setup.rounds):
        seconds: dict[str, float] = {}
        for method in list(methods):
            if method.name in failures:
                continue
            dist.barrier()
            try:
                if r == 0:
                    first[method.name] = run_step(method, rank)
                    tied_error[method.name] = _relative_error(method.tied(), tied_grad)
                start = time.perf_counter()
                for _ in range(setup.steps):
                    run_step(method, rank)
                elapsed = (time.perf_counter() - start) / setup.steps
            except Exception as exc:  # noqa: BLE001
                failures[method.name] = f"step: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                continue
            took = torch.tensor([elapsed])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when both ranks are done
            seconds[method.name] = float(took)
        rounds.append(seconds)
        if rank == 0:
            print(f"round {r + 1}/{setup.rounds}: {seconds}", file=sys.stderr, flush=True)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, (first, tied_error, failures))
    if rank == 0:
        merged = {k: v for part, _, _ in gathered for k, v in part.items() if v is not None}
        tied = {k: max(p[1].get(k, 0.0) for p in gathered) for k in merged}
        failed = {k: v for _, _, part in gathered for k, v in part.items()}
        torch.save({"rounds": rounds, "first": merged, "tied": tied, "reference": reference,
                    "failures": failed, "timed": timed}, out_path)  # fmt: skip
    end_distributed()  # every group freed now, not during the shutdown


def _relative_error(held: list[tuple[str, torch.Tensor]], want: dict[str, torch.Tensor]) -> float:
    """How far each embedding parameter held here is from the plain model's gradient for it
    (tied: the sum of both uses); 0 for an exact one."""
    errors = [0.0]
    for name, p in held:
        ref = want[next(s for s in TIED if name.endswith(s))]
        grad = torch.zeros_like(ref) if p.grad is None else p.grad
        errors.append(float((grad - ref).norm() / ref.norm()))
    return max(errors)


def run(setup: Setup) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.start_processes(_worker, args=(port, setup, out), nprocs=2, start_method="spawn")
        return torch.load(out, weights_only=False)


def table(setup: Setup, results: dict[str, Any], load: tuple[str, str]) -> str:
    rounds = results["rounds"]
    names = [n for n in rounds[0]]
    median = {n: statistics.median(r[n] for r in rounds if n in r) for n in names}
    tokens = setup.batch * setup.seq
    timed = results.get("timed")
    cut = f", -timed: before {cut_name(setup, timed)} (balance_by_time)" if timed else ""
    lines = [
        f"GPT-2 shape: {setup.layers} layers, width {setup.width}, {setup.heads} heads, "
        f"vocabulary {setup.vocab}, embeddings {'tied' if setup.tied else 'untied'}; "
        f"batch {setup.batch} x {setup.seq} tokens, K=2 (cut before "
        f"{cut_name(setup, even_balance(setup))}{cut}), M={setup.chunks}, checkpoint never; "
        f"median of {setup.rounds} rounds; load before / after: {load[0]} / {load[1]}",
        "",
        "| method | tokens/s | step s | x pippy, same schedule and cut | x pippy, same schedule, "
        "even cut | first loss - plain | embedding gradient error |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        same, even = _peers(name)
        ratios = [f"{median[p] / median[name]:.2f}" if p in median else "-" for p in (same, even)]
        loss = results["first"].get(name)
        off = f"{loss - results['reference']:+.1e}" if loss is not None else "-"
        tied = results["tied"].get(name)
        err = "-" if tied is None else f"{tied:.1e}"
        lines.append(
            f"| {name} | {tokens / median[name]:.0f} | {median[name]:.3f} | {ratios[0]} | "
            f"{ratios[1]} | {off} | {err} |"
        )
    lines += [
        "",
        f"plain model's loss on the batch: {results['reference']:.5f}; embedding gradient "
        "error: |g - g_plain| / |g_plain| after the first step, worst of the input and output "
        "embeddings held on any rank (tied: the plain model's gradient sums both uses)",
    ]
    wrong = [n for n, v in results["first"].items() if abs(v - results["reference"]) > 1e-3]
    failures = dict(results["failures"])
    for name in wrong:
        failures.setdefault(name, f"loss {results['first'][name]:.5f} is not the plain model's")
    for name, error in results["tied"].items():
        if error > 1e-3:
            why = (
                ": each stage keeps its own copy, whose gradient is only its own use's part "
                "(summing the copies before the optimizer step is left to the user)"
                if setup.tied
                else ""
            )
            failures.setdefault(
                name, f"the embedding gradient is {error:.0%} off the plain model's{why}"
            )
    lines.append("failures: " + ("none" if not failures else ""))
    lines += [f"- {name}: {why}" for name, why in sorted(failures.items())]
    return "\n".join(lines)


def _peers(name: str) -> tuple[str, str]:
    """The pippy methods a row compares with: same schedule and cut, same schedule evenly cut.

    >>> _peers("gp-dist-1f1b-timed")
    ('pippy-1f1b-timed', 'pippy-1f1b')
    """
    rest = name.split("-", 2)[2] if name.startswith("gp-") else name.split("-", 1)[1]
    return f"pippy-{rest}", f"pippy-{rest.removesuffix('-timed')}"


def main() -> None:
    args = parse()
    setup = replace(
        QUICK if args.quick else FULL,
        tied=not args.untied,
        schedules=tuple(args.schedules.split(",")),
    )
    if args.rounds:
        setup = replace(setup, rounds=args.rounds)
    before = os.getloadavg()
    results = run(setup)
    after = os.getloadavg()
    load = (f"{before[0]:.2f}", f"{after[0]:.2f}")
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}")
    print(table(setup, results, load))


if __name__ == "__main__":
    main()
