# Command:  python recipes/transparency.py            (full: about an hour on 2 shared cores)
#           python recipes/transparency.py --quick    (tiny sizes, a few steps; the tests)
# Hardware: any CPU; K CPU stand-in devices, one intra-op thread each.
# Reproduces: GPipe's claim that pipelining is transparent: gradients of all M micro-batches
#           are accumulated and applied once, so "the result does not depend on K" (Section 2).
#           Expected: every pipelined loss curve equals the plain model's within float tolerance
#           (bit for bit against a plain run that adds the micro-batch gradients in the
#           same order), for K = 2 and 4, each M and every schedule.
"""Transparency: the quick-start models trained plain and pipelined from the same seed.

Models: the quick-start AmoebaNet-D (3, 16) on generated 32 px images (``recipe=
amoebanet_quickstart``, with drop-path 0.2 so that RNG replay matters) and the quick-start
Transformer T(L, H, A) on the generated translation corpus (``recipe=transformer_quickstart``,
4 + 4 layers so that K=4 x V=2 interleaved stages exist, dropout 0.1). For each:

    plain        the un-pipelined model, micro-batch by micro-batch (gradient accumulation),
                 dropout seeded as the engine seeds it (giantpipe.engine.rng.rng_context), BatchNorm
                 deferred as in the pipeline: the same mathematics, no pipeline
    K, M, sched  GPipe over K CPU stand-ins with M micro-batches, (K, M) = (2, 4), (2, 8),
                 (4, 8), under each schedule: gpipe / 1f1b / interleaved (V=2) / zb-h1; the
                 recipe's re-materialization

Same seed, same batches (the translation batches are bucketed with min_sentences = the largest
M, so every run sees the same ones), same optimizer and LR schedule (the runner's builders), one
intra-op thread everywhere. Writes ``results/transparency/transparency.md`` (final loss, eval loss
and accuracy / BLEU, the largest loss and parameter differences from the plain run with the same
M) and ``transparency.png`` (the curves overlaid, and their differences on a log scale).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.testing.outputs import add_output_options, output_path  # noqa: E402


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, a few steps (for tests)")
    add_output_options(p, "transparency")
    p.add_argument("--only", nargs="+", choices=["amoebanet", "transformer"])
    return p.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
from torch import nn

from giantpipe.data.bundle import DataBundle  # noqa: E402
from giantpipe.engine import GPipe, convert_deferred_batch_norm  # noqa: E402
from giantpipe.engine.batchnorm import commit_deferred_batch_norm  # noqa: E402
from giantpipe.engine.rng import draw_step_seed, install_rng_hooks  # noqa: E402
from giantpipe.engine.schedules import SCHEDULE_NAMES, build_schedule  # noqa: E402
from giantpipe.perf.balance import balance_by_params  # noqa: E402
from giantpipe.runner.evaluate import evaluate  # noqa: E402
from giantpipe.runner.losses import build_loss  # noqa: E402
from giantpipe.runner.lr_schedule import lr_multiplier  # noqa: E402
from giantpipe.runner.optim import build_optimizer  # noqa: E402
from giantpipe.runner.registry import build_from_target  # noqa: E402
from giantpipe.runner.seeding import seed_everything  # noqa: E402
from giantpipe.runner.step import accumulate_gradients  # noqa: E402
from giantpipe.testing import accumulate_micro_batches  # noqa: E402
from giantpipe.testing.reference import plain_model  # noqa: E402

StepFn = Callable[[Any, Any], float]


@dataclass(frozen=True)
class Setup:
    """One model's experiment: a recipe, its overrides, and the grid of pipelines."""

    key: str
    title: str
    recipe: str
    overrides: tuple[str, ...]
    steps: int
    cells: tuple[tuple[int, int], ...] = ((2, 4), (2, 8), (4, 8))  # (K, M) pipelines

    @property
    def ms(self) -> list[int]:
        return sorted({m for _, m in self.cells})


FULL = (
    Setup("amoebanet", "AmoebaNet-D (3, 16), drop-path 0.2", "amoebanet_quickstart",
          ("model.drop_path=0.2", "trainer.eval_every=0"), steps=50),
    Setup("transformer", "Transformer T(4, 256, 4), dropout 0.1", "transformer_quickstart",
          ("model.num_layers=4", "model.dropout=0.1", "data.min_sentences=8",
           "trainer.eval_every=0"), steps=100),
)  # fmt: skip
QUICK = (
    Setup("amoebanet", "AmoebaNet-D (3, 8), drop-path 0.2 (quick)", "amoebanet_quickstart",
          ("model.num_filters=8", "model.drop_path=0.2", "data.train_size=64",
           "data.eval_size=32", "data.batch_size=16", "trainer.eval_every=0"),
          steps=3, cells=((2, 2),)),
    Setup("transformer", "Transformer T(2, 64, 2), dropout 0.1 (quick)", "transformer_quickstart",
          ("model.num_layers=2", "model.d_model=32", "model.ffn_dim=64", "model.num_heads=2",
           "model.head_dim=16", "model.dropout=0.1", "data.min_sentences=2",
           "data.max_tokens=256", "data.bleu_sentences=8", "data.generated_train_sizes=[64,32,16]",
           "data.generated_eval_size=8", "trainer.eval_every=0"),
          steps=3, cells=((2, 2),)),
)  # fmt: skip


@dataclass(frozen=True)
class Config:
    """One training run: K=1 is a plain reference ("plain" or "plain fill-drain")."""

    k: int
    m: int
    schedule: str = "plain"

    @property
    def label(self) -> str:
        where = f"M={self.m}" if self.k == 1 else f"K={self.k}, M={self.m}"
        return f"{self.schedule}, {where}"

    @property
    def reference(self) -> Config:
        """The plain run that adds gradients up in this run's order."""
        return Config(1, self.m, "plain fill-drain" if self.schedule == "gpipe" else "plain")


@dataclass
class Run:
    config: Config
    losses: list[float] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0


def compose(recipe: str, overrides: Sequence[str]) -> Any:
    """The experiment config the runner would build (dataclasses)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from giantpipe.cli.checks import to_experiment
    from giantpipe.cli.registration import register_configs

    register_configs(ROOT / "conf")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return to_experiment(hydra_compose("config", [f"recipe={recipe}", *overrides]))


def configs(setup: Setup) -> list[Config]:
    """Plain at each M, then every schedule that runs at each (K, M)."""
    out = [Config(1, m, plain) for m in setup.ms for plain in ("plain", "plain fill-drain")]
    for k, m in setup.cells:
        for name in SCHEDULE_NAMES:
            try:
                build_schedule(name, k, m, 2 if name == "interleaved" else 1)
            except ValueError:
                continue  # e.g. interleaved needs M divisible by K
            out.append(Config(k, m, name))
    return out


# ---- the two ways to take a step -------------------------------------------------------------


def plain_step(
    model: nn.Sequential, bundle: DataBundle, loss_fn: Any, chunks: int, fill_drain: bool
) -> StepFn:
    """The un-pipelined model on the engine's micro-batches, weighted as the engine weighs them
    (mean losses by micro-batch size, summed losses by the whole batch's normalizer), dropout
    seeded per micro-batch from one seed per step drawn like the engine's.

    Gradients add up in the order the schedule runs the backwards, since float addition is not
    associative: micro-batch by micro-batch (1F1B, interleaved, zero bubble), or with
    ``fill_drain`` all forwards first and the backwards last-in first-out (GPipe)."""

    def step(inputs: Any, targets: Any) -> float:
        seed = draw_step_seed()
        losses = accumulate_micro_batches(
            model, inputs, targets, chunks, seed, loss_fn, bundle.loss_normalizer,
            fill_drain=fill_drain,
        )  # fmt: skip
        commit_deferred_batch_norm(model)  # running statistics once per mini-batch
        return float(torch.stack(losses).sum())  # as the engine

    return step


def pipe_step(pipe: GPipe, bundle: DataBundle, loss_fn: Any) -> StepFn:
    """The runner's own step (giantpipe.runner.step.accumulate_gradients) over the pipeline."""

    def step(inputs: Any, targets: Any) -> float:
        devices = [str(d) for d in pipe.worker_devices]
        loss, _ = accumulate_gradients(
            pipe, [(inputs, targets)], loss_fn, bundle.loss_normalizer, "fp32", devices
        )
        return loss

    return step


def build(
    cfg: Any, bundle: DataBundle, config: Config, loss_fn: Any
) -> tuple[nn.Sequential, nn.Module, StepFn]:
    """The model (seeded as the runner seeds it) and it wrapped for ``config`` (same layers)."""
    seed_everything(cfg.trainer.seed)
    model = plain_model(cfg, bundle)
    if config.k == 1:
        if cfg.pipeline.deferred_batch_norm:
            convert_deferred_batch_norm(model)
        install_rng_hooks(model)
        fill_drain = config.schedule == "plain fill-drain"
        return model, model, plain_step(model, bundle, loss_fn, config.m, fill_drain)
    v = 2 if config.schedule == "interleaved" else 1
    pipe = GPipe(
        model,
        balance_by_params(config.k * v, model),
        devices=["cpu"] * config.k,
        chunks=config.m,
        recompute=cfg.pipeline.recompute,
        deferred_batch_norm=cfg.pipeline.deferred_batch_norm,
        schedule=config.schedule,
        virtual_stages=v,
        threads_per_worker=1,
    )
    return model, pipe, pipe_step(pipe, bundle, loss_fn)


def train(cfg: Any, bundle: DataBundle, config: Config, steps: int) -> Run:
    """``steps`` optimizer steps as the runner takes them, then the evaluation."""
    started = time.perf_counter()
    summed = bundle.loss_normalizer is not None
    loss_fn = build_loss(bundle.loss, cfg.trainer.label_smoothing, bundle.ignore_index, summed)
    model, module, step = build(cfg, bundle, config, loss_fn)
    params = list(module.parameters())  # one order for both: clipping sums norms in order
    optimizer = build_optimizer(params, cfg.optim)
    factor = lr_multiplier(cfg.optim.lr_schedule, bundle.batches_per_epoch, steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    stream = bundle.train_batches(cfg.trainer.seed, 0)
    run = Run(config)
    for _ in range(steps):
        inputs, targets = next(stream)
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(step(inputs, targets))
        if cfg.trainer.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.trainer.grad_clip)
        optimizer.step()
        scheduler.step()
    run.figures = evaluate(module, bundle, cfg.trainer.eval_batches, "fp32", ["cpu"])
    if bundle.evaluate_model is not None:  # BLEU: greedy decoding on the plain model, whose
        extra = bundle.evaluate_model(model)  # layers the pipeline trained (in place on CPU)
        run.figures.update({k: float(v) for k, v in extra.items() if not isinstance(v, str)})
    run.params = {n: p.detach().clone() for n, p in module.named_parameters()}
    run.seconds = time.perf_counter() - started
    return run


# ---- the table and the plot -----------------------------------------------------------------


def differences(run: Run, plain: Run) -> tuple[float, float]:
    """Largest |delta loss| over the steps and largest |delta parameter| at the end."""
    dloss = max(abs(a - b) for a, b in zip(run.losses, plain.losses))
    dparam = max(
        float((p - plain.params[n]).abs().max()) for n, p in run.params.items()
    )  # parameters keep the plain model's names inside GPipe
    return dloss, dparam


def metric(run: Run) -> str:
    if "bleu" in run.figures:
        return f"BLEU {run.figures['bleu']:.2f}"
    if "accuracy" in run.figures:
        return f"acc {run.figures['accuracy']:.4f}"
    return "-"


def table(setup: Setup, runs: Sequence[Run]) -> str:
    by_config = {r.config: r for r in runs}
    lines = [
        f"### {setup.title}: `recipe={setup.recipe} {' '.join(setup.overrides)}`, "
        f"{setup.steps} steps",
        "",
        "| run | final train loss | eval loss | eval metric | max abs Δ train loss vs plain, "
        "same order | max abs Δ parameter vs plain, same order | max abs Δ train loss vs plain "
        "in micro-batch order | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        dloss, dparam = differences(r, by_config[r.config.reference])
        in_order = differences(r, by_config[Config(1, r.config.m)])[0]
        lines.append(
            f"| {r.config.label} | {r.losses[-1]:.6f} | {r.figures['loss']:.6f} | {metric(r)} "
            f"| {dloss:.2e} | {dparam:.2e} | {in_order:.2e} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, tuple[Setup, list[Run]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7), squeeze=False)
    for col, (setup, runs) in enumerate(results.values()):
        by_config = {r.config: r for r in runs}
        top, bottom = axes[0][col], axes[1][col]
        for i, r in enumerate(runs):
            steps = range(1, len(r.losses) + 1)
            plain = r.config.k == 1
            color = "black" if plain else f"C{i % 10}"
            top.plot(steps, r.losses, label=r.config.label, color=color,
                     linewidth=4 if plain else 0.8, alpha=0.3 if plain else 1.0)  # fmt: skip
            # pipelined runs against their plain reference; the fill-drain plain against the
            # in-order one: what float addition order alone does to the curve
            ref = by_config[Config(1, r.config.m) if plain else r.config.reference]
            if ref is not r:
                delta = [max(abs(a - b), 1e-12) for a, b in zip(r.losses, ref.losses)]
                bottom.semilogy(steps, delta, linewidth=2 if plain else 0.8, color=color,
                                linestyle="--" if plain else "-", label=r.config.label)  # fmt: skip
        top.set(title=f"{setup.title}: train loss", xlabel="step", ylabel="loss")
        bottom.set(title="|Δ loss| vs plain in the same order (dashed: the two plain orders)",
                   xlabel="step", ylabel="|Δ loss|, floored at 1e-12", ylim=(1e-13, 1))  # fmt: skip
        for ax in (top, bottom):
            ax.legend(fontsize=5, ncol=2)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_setup(setup: Setup) -> list[Run]:
    overrides = (*setup.overrides, f"trainer.max_steps={setup.steps}")
    cfg = compose(setup.recipe, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        # One bundle for every run: the same batches (and, for translation, one vocabulary).
        bundle = build_from_target(cfg.data, "data", run_dir=Path(tmp))
        runs = []
        for config in configs(setup):
            runs.append(train(cfg, bundle, config, setup.steps))
            print(f"{setup.key}: {config.label}: loss {runs[-1].losses[-1]:.6f} "
                  f"({runs[-1].seconds:.0f}s)", flush=True)  # fmt: skip
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    args.out = output_path(args, ROOT, "transparency")
    torch.set_num_threads(1)  # the plain runs on one core, each stage on one core
    started, load = datetime.datetime.now(), os.getloadavg()[0]
    setups = [s for s in (QUICK if args.quick else FULL) if not args.only or s.key in args.only]
    results = {s.key: (s, run_setup(s)) for s in setups}
    header = (
        f"# Transparency: plain vs pipelined from the same seed"
        f"{' (--quick)' if args.quick else ''}\n\n"
        f"`python recipes/transparency.py{' --quick' if args.quick else ''}`, "
        f"{started:%Y-%m-%d %H:%M}, torch {torch.__version__}, {os.cpu_count()} CPUs (shared), "
        f"no GPU, one intra-op thread per stage; load average {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end.\n\n"
        "The plain reference of a run has the same M and adds the micro-batches' gradients in "
        "the same order: GPipe's fill-drain runs the backwards last-in first-out, the other "
        "schedules in micro-batch order. Float addition is not associative, so the two orders "
        "differ in the last bit at the first step, and Adam amplifies that over the steps (last "
        "Δ column, and the dashed line of the plot).\n"
    )
    text = "\n\n".join([header, *(table(s, runs) for s, runs in results.values())])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transparency.md").write_text(text + "\n")
    plot(results, args.out / "transparency.png")
    print(text)
    worst = max(
        differences(r, next(p for p in runs if p.config == r.config.reference))[0]
        for _, runs in results.values()
        for r in runs
    )
    return 0 if math.isfinite(worst) else 1


if __name__ == "__main__":
    raise SystemExit(main())
