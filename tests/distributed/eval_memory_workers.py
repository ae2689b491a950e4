"""What each rank runs in tests/distributed/test_eval_memory.py: a tiny translation run
through the runner (build, two optimizer steps, the final evaluation with held-out BLEU), and
what this process holds right after that evaluation: parameters and the bytes of every live
tensor, against its stages' weights, gradients and optimizer state."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.distributed.generate_workers import TRANSLATION
from tests.timeouts import scaled

# A model big enough that half of it dwarfs the data a rank holds (token ids, a vocabulary).
WIDER = ["model.d_model=64", "model.head_dim=16", "model.ffn_dim=128", "model.num_heads=4"]


def live_tensors() -> tuple[int, int]:
    """(parameters, bytes) this process holds: the elements of every live ``nn.Parameter`` and
    the bytes of the unique storages of every live tensor (CPU has no allocator statistics in
    torch 2.14: the garbage collector's list of tensors stands in). Meta tensors hold nothing."""
    gc.collect()
    params, storages = 0, {}
    for obj in gc.get_objects():
        # type(), not isinstance: a deprecated module attribute warns when asked its __class__
        if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":
            continue
        try:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a fake tensor (left by a torch.export in this process): no data
            continue
        if issubclass(type(obj), nn.Parameter):
            params += obj.numel()
    storages.pop(0, None)  # empty tensors
    return params, sum(storages.values())


def training_state(parts: Any) -> dict[str, int]:
    """Bytes of what a rank must hold to train its stages: weights, gradients, optimizer state."""
    params = list(parts.pipe.parameters())
    state = [t for s in parts.optimizer.state.values() for t in s.values()]
    return {
        "params": sum(p.numel() for p in params),
        "weights": sum(p.nbytes for p in params),
        "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer": sum(t.nbytes for t in state if isinstance(t, torch.Tensor)),
    }


def run(tmp: Path, run_dir: str, executor: str, overrides: list[str]) -> dict[str, Any]:
    """The run through the runner's own loop; the measure is taken inside its final evaluation
    (the training state, caches and data all still alive)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from giantpipe.cli.checks import to_experiment
    from giantpipe.cli.registration import register_configs
    from giantpipe.runner import loop
    from giantpipe.runner.run import _train
    from giantpipe.runner.world import TorchrunWorld, World
    from tests.support.ranks import REPO

    every = [*TRANSLATION, *WIDER, "trainer.max_steps=2", "trainer.eval_every=0"]
    every += [
        "trainer.predict=false",
        f"pipeline.executor={executor}",
        f"pipeline.timeout={scaled(30):g}",
    ]
    register_configs(REPO / "conf")
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        composed = compose("config", [*every, *overrides])
    cfg = to_experiment(composed)
    world = TorchrunWorld(30.0) if executor == "distributed" else World()
    seen: dict[str, Any] = {}
    evaluate = loop.TrainingLoop.evaluate

    def measured(self: loop.TrainingLoop) -> None:
        evaluate(self)
        seen.update(training_state(self.parts), kept_model=self.parts.model is not None)
        seen["live_params"], seen["live_bytes"] = live_tensors()
        seen["bleu"] = self.last_eval["bleu"]

    loop.TrainingLoop.evaluate = measured  # type: ignore[method-assign]
    try:
        yaml = OmegaConf.to_yaml(composed, resolve=True)
        _train(cfg, Path(run_dir), yaml, world, time.perf_counter(), ())
    finally:
        loop.TrainingLoop.evaluate = evaluate  # type: ignore[method-assign]
    return seen
