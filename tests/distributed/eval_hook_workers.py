"""What each process runs in tests/distributed/test_eval_hooks.py: a small language-model run
through the runner (build, four optimizer steps, evaluations at steps 2 and 4) whose data has a
user's whole-model evaluation hook (:func:`lm_with_hook`), and what the process holds while
that hook runs: its live parameters after each call, the most bytes FSDP2 gathered at once
during them."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import torch
from torch import nn

from giantpipe.data.bundle import DataBundle
from giantpipe.data.lm_tokens import lm_tokens
from giantpipe.engine.inference import PipedModel
from giantpipe.testing.held import storage_bytes
from tests.distributed.replica_generation_workers import GatherWatch
from tests.support.ranks import REPO

SEEN: dict[str, Any] = {}
"""This process's notes from inside the hook (each process its own)."""

OVERRIDES = [
    "recipe=transformer_lm_scaling",
    "pipeline=cpu_k2",
    "pipeline.chunks=2",
    "model.num_layers=2",
    "model.d_model=32",
    "model.ffn_dim=64",
    "model.num_heads=2",
    "model.vocab_size=64",
    "model.max_len=32",
    "data.vocab_size=64",
    "data.seq_len=16",
    "data.batch_size=8",
    "data.eval_samples=2",
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "trainer.predict=false",
    "logger.progress=none",
]


def live_parameter_bytes() -> int:
    """Bytes of every live parameter of this process (an FSDP2 parameter, a DTensor: its own
    shard), each storage once; parameters on the meta device hold nothing."""
    gc.collect()
    # type() first: a deprecated module attribute warns when asked its __class__
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    params = [t for t in tensors if isinstance(t, nn.Parameter) and t.device.type != "meta"]
    return storage_bytes(params)


def largest_layer(pipe: nn.Module) -> int:
    """Bytes of the largest layer this process holds, whole (a DTensor's numel is its whole)."""
    layers = [layer for stage in pipe.partitions for layer in stage.children()]
    return max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)


def lm_with_hook(**fields: Any) -> DataBundle:
    """``data=lm_tokens`` with its samples, and a user's hook written as for a plain model:
    the share of a held-out batch's next tokens the model's arg-max gets right, then the
    samples (a decode through the pipe). It notes what this process holds meanwhile."""
    bundle = lm_tokens(**fields)
    samples = bundle.evaluate_model
    assert samples is not None
    inputs, targets = bundle.eval_batches()[0]

    def hook(model: PipedModel) -> dict[str, float | str]:
        with GatherWatch(model.pipe) as watch:
            logits = model(inputs)
            right = logits.argmax(-1) == targets.to(logits.device)  # type: ignore[union-attr]
            figures: dict[str, float | str] = {"argmax_right": float(right.float().mean())}
            figures.update(samples(model))
        SEEN.setdefault("live", []).append(live_parameter_bytes())
        SEEN["peak_gathered"], SEEN["largest_layer"] = watch.peak, largest_layer(model.pipe)
        SEEN["own"] = storage_bytes(model.pipe.parameters())
        return figures

    hook.generates = True  # type: ignore[attr-defined]
    return dataclasses.replace(bundle, evaluate_model=hook)


def run(tmp: Path, overrides: list[str]) -> dict[str, Any]:
    """The run (local in one process, or this rank's under the launcher), its evaluations'
    figures as rank 0 logged them, and this process's notes."""
    from unittest import mock

    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from giantpipe.cli.checks import to_experiment
    from giantpipe.cli.registration import register_configs
    from giantpipe.metrics.jsonl import read_jsonl
    from giantpipe.runner import train

    register_configs(REPO / "conf")
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = to_experiment(compose("config", [*OVERRIDES, *overrides]))
    data = {f.name: getattr(cfg.data, f.name) for f in dataclasses.fields(cfg.data)}
    cfg.data = {**data, "_target_": "tests.distributed.eval_hook_workers.lm_with_hook"}
    SEEN.clear()
    # The runner leaves the world at the end; the launcher does that, after the result.
    with mock.patch.object(dist, "destroy_process_group", lambda *_, **__: None):
        summary = train(cfg, tmp / "run", "")
    assert summary["status"] == "completed", summary
    evals = []
    if (tmp / "run" / "metrics.jsonl").exists():
        evals = [r for r in read_jsonl(tmp / "run" / "metrics.jsonl") if r["kind"] == "eval"]
    return {"evals": evals, "summary": summary, **SEEN}
