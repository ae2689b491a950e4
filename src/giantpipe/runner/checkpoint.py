"""Checkpoints: one format for both executors, shards by un-partitioned names plus a manifest.

A checkpoint is a directory (``RUN/last/``, ``RUN/step_N/``) in the shard format of
:mod:`giantpipe.engine.dist.shards`, with the run's state beside the weights::

    last/
      manifest.json                              the commit point; extra: step, position, files
      step000000100-3f9c2a-rank00000.pt          weights of rank 0's stages ("0.weight", ...)
      step000000100-3f9c2a-rank00001.pt          (torchrun; a local run writes this one shard)
      state-step000000100-8b01de-rank00000.pt    rank 0: optimizer (by parameter name), EMA,
      state-step000000100-8b01de-rank00001.pt    LR schedule, fp16's loss scale, RNG, step
                                                 and data position

Every file is fsynced under a temporary name before it is moved into place, and the manifest,
written last, makes the save count: a crash at any moment leaves the previous checkpoint whole.
Optimizer and EMA state are keyed by parameter NAME, so a run resumes under another K, R or
executor (a torchrun run resumes in one process and back): every rank gathers its names from
whichever files hold them. RNG states come from the same rank where it existed.
``python -m giantpipe.consolidate RUN/last model.pt`` merges the weights for the plain model.
The process's random-number generators are seeded once at the start (:func:`seed_everything`)
and their states saved and restored here (:func:`rng_state`, :func:`restore_rng`).

Files of the earlier format, one ``.pt`` holding everything (``last.pt``), still load for
``trainer.resume`` (and for ``trainer.init_from``: :mod:`giantpipe.runner.finetune`).

Example::

    save_run(parts, progress, run_dir / "last", world)      # every rank
    progress = restore(parts, run_dir / "last", world)      # any K, R or executor
    read_checkpoint(run_dir / "last")["step"]               # 100
"""

from __future__ import annotations

import pickle
import random
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from giantpipe.config import ConfigError
from giantpipe.engine.dist import shards
from giantpipe.engine.dist.shards import atomic_save

if TYPE_CHECKING:
    from giantpipe.runner.build import Experiment
    from giantpipe.runner.world import World

__all__ = [
    "atomic_save",
    "read_checkpoint",
    "restore",
    "restore_rng",
    "rng_state",
    "save_run",
    "seed_everything",
]

RUN_FORMAT = "giantpipe-run/1"
LEGACY_VERSION = 1
LEGACY_KEYS = ("format_version", "step", "position", "model", "optimizer", "rng")
RESUME = "trainer.resume"


@dataclass
class Progress:
    """Where the run is: optimizer steps done and training batches consumed."""

    step: int = 0
    position: int = 0


@dataclass(frozen=True)
class Place:
    """Where this process sits: its rank, its replica, the stages it holds, K, R, placement."""

    rank: int
    replica: int
    stages: list[int]
    workers: int
    replicas: int
    placement: list[int]


def place_of(pipe: Any) -> Place:
    """The place of ``pipe``'s process (a GPipe holds every stage, in a world of one)."""
    layout = getattr(pipe, "layout", None)
    if layout is None:
        stages = list(range(len(pipe.partitions)))
        return Place(0, 0, stages, pipe.num_workers, 1, list(pipe.placement))
    return Place(
        layout.rank,
        layout.replica,
        layout.local_stages,
        layout.workers,
        layout.replicas,
        list(layout.placement),
    )


# -- parameters and optimizer state by name ---------------------------------------------------


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[str, nn.Parameter]
) -> dict[str, Any]:
    """The optimizer's state_dict with parameter indices replaced by names."""
    name_of = {id(p): n for n, p in names.items()}
    state = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        for index, param in zip(saved["params"], live["params"], strict=True):
            index_to_name[index] = name_of[id(param)]
    return {
        "state": {index_to_name[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [index_to_name[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], names: Mapping[str, nn.Parameter]
) -> None:
    """Load a name-keyed optimizer state into ``optimizer``, whatever the parameter order."""
    name_of = {id(p): n for n, p in names.items()}
    live_groups = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved_groups = state["param_groups"]
    if [sorted(g) for g in live_groups] != [sorted(g["params"]) for g in saved_groups]:
        raise ValueError("optimizer parameters differ from the checkpoint's")
    for saved, live in zip(saved_groups, optimizer.param_groups, strict=True):
        if set(saved) != set(live):  # e.g. an sgd checkpoint (momentum) into adamw (betas)
            raise ValueError(f"optimizer settings {sorted(set(saved) ^ set(live))} differ")
    index_of = {name: i for i, name in enumerate(n for g in live_groups for n in g)}
    optimizer.load_state_dict(
        {
            "state": {index_of[n]: s for n, s in state["state"].items()},
            "param_groups": [
                {**saved, "params": [index_of[n] for n in live]}
                for saved, live in zip(saved_groups, live_groups, strict=True)
            ],
        }
    )


def check_model_fits(saved: Mapping[str, Tensor], live: Mapping[str, Tensor], path: Path) -> None:
    """Raise a one-line ConfigError unless the saved weights have this model's names and shapes."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    if missing or unexpected:
        raise ConfigError(
            RESUME,
            f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}",
        )
    for name, tensor in live.items():
        if tuple(saved[name].shape) != tuple(tensor.shape):
            raise ConfigError(
                RESUME,
                f"{path} does not fit this model: {name} has shape {tuple(saved[name].shape)} "
                f"in the checkpoint, {tuple(tensor.shape)} here",
            )


# -- saving ----------------------------------------------------------------------------------


def state_file(token: str, rank: int) -> str:
    return f"state-{token}-rank{rank:05d}.pt"


def save_run(parts: Experiment, progress: Progress, directory: Path, world: World) -> None:
    """Collective: every rank writes its run state, replica 0 its weights; rank 0 commits."""
    pipe, place = parts.pipe, place_of(parts.pipe)
    token = world.from_rank0(shards.new_token(progress.step))
    leader = place.replica == 0  # replicas hold the same optimizer state and EMA
    state = {
        "rank": place.rank,
        "step": progress.step,
        "position": progress.position,
        "scheduler": parts.scheduler.state_dict(),
        "rng": rng_state(),
        "optimizer": optimizer_state_by_name(parts.optimizer, parts.names) if leader else None,
        "ema": parts.ema.state_dict() if leader and parts.ema is not None else None,
        # fp16: the loss scale and its growth count, the same on every rank (one verdict)
        "grad_scaler": parts.grad_scaler.state_dict() if parts.grad_scaler is not None else None,
    }
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save(state, directory / state_file(token, place.rank))
    entry = (
        shards.write_shard(pipe.state_dict(), directory, token, place.rank, place.stages)
        if leader
        else None
    )
    entries = world.gather(entry)
    if world.rank == 0:
        files = [state_file(token, r) for r in range(world.size)]
        meta = {
            "step": progress.step,
            "balance": list(pipe.balance),
            "schedule": pipe.schedule,
            "chunks": pipe.chunks,
            "workers": place.workers,
            "replicas": place.replicas,
            "placement": place.placement,
        }
        extra = {
            "format": RUN_FORMAT,
            "step": progress.step,
            "position": progress.position,
            "state_files": files,
            "leader_ranks": list(range(world.size // place.replicas)),  # replica 0's ranks
            "ema": parts.ema is not None,
        }
        shards.commit(directory, [e for e in entries if e is not None], meta, extra)
        for path in directory.glob("state-*-rank*.pt"):
            if path.name not in files:
                path.unlink(missing_ok=True)
    world.barrier()


# -- reading ---------------------------------------------------------------------------------


def _allowed() -> list[Any]:
    """What a checkpoint may hold besides tensors and plain values: numpy's RNG state, as
    checkpoints of the earlier format saved it (when numpy was loaded)."""
    try:
        import numpy as np
        from numpy._core.multiarray import _reconstruct
    except ImportError:
        return []
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def safe_load(path: Path, key: str = RESUME, mmap: bool = False) -> Any:
    """``torch.load`` with ``weights_only``: tensors, plain values and numpy's RNG state, nothing
    that runs code. A file that needs more, or is no checkpoint, is a ConfigError naming it.

    Example::

        state = safe_load(Path("outputs/run/last.pt"), "trainer.resume")
    """
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(err))
        if unsafe is None:
            raise ConfigError(
                key, f"{path} is not a readable checkpoint (not a torch file)"
            ) from err
        raise ConfigError(
            key,
            f"{path} holds {unsafe.group(1)}, which giantpipe never saves; refused without "
            "running it (load it yourself only if you trust where it came from)",
        ) from err
    except Exception as err:  # a truncated or foreign file: say which one
        raise ConfigError(key, f"{path} is not a readable checkpoint ({err})") from err


def _load(path: Path) -> Any:
    return safe_load(path, RESUME, mmap=True)


def run_extra(directory: Path, key: str = RESUME) -> dict[str, Any]:
    """The run state's entry in a checkpoint directory's manifest; ConfigError naming ``key``."""
    try:
        manifest = shards.read_manifest(directory)
    except (OSError, ValueError) as err:
        raise ConfigError(key, f"{directory} is not a readable checkpoint ({err})") from err
    extra: dict[str, Any] = manifest.get("extra") or {}
    if extra.get("format") != RUN_FORMAT:
        raise ConfigError(
            key,
            f"{directory} holds weights without run state; start a new run from them with "
            "python -m giantpipe.consolidate DIR model.pt and trainer.init_from=model.pt",
        )
    return extra


def restore(parts: Experiment, path: Path, world: World) -> Progress:
    """Load a checkpoint (a directory, or a ``.pt`` file of the earlier format) into the built
    parts; ConfigError naming trainer.resume if it does not fit."""
    if path.is_dir():
        return restore_run(parts, path, world.rank)
    return restore_legacy(parts, path, whole=world.size == 1)


def restore_run(parts: Experiment, directory: Path, rank: int) -> Progress:
    """Weights, optimizer, EMA, LR schedule and RNG for this process's names (any layout)."""
    extra = run_extra(directory)
    live = parts.pipe.state_dict()
    try:
        saved = shards.load(directory, live.keys())
    except KeyError as err:
        raise ConfigError(RESUME, f"{directory} does not fit this model ({err.args[0]})") from err
    check_model_fits(saved, live, directory)
    files = [directory / name for name in extra["state_files"]]
    leaders = [_load(files[r]) for r in extra["leader_ranks"]]
    if parts.ema is not None and not extra.get("ema"):
        raise ConfigError("trainer.ema_decay", f"{directory} was saved without an EMA")
    _restore_optimizer(parts, leaders, directory)
    parts.pipe.load_state_dict(saved)
    if parts.ema is not None:
        parts.ema.load_state_dict(
            {n: t for s in leaders for n, t in s["ema"].items() if n in parts.ema.shadow}
        )
    parts.scheduler.load_state_dict(leaders[0]["scheduler"])
    _restore_grad_scaler(parts, leaders[0])
    if rank < len(files):  # a rank new to the layout keeps its seeded generators
        restore_rng(_load(files[rank])["rng"])
    return Progress(step=int(extra["step"]), position=int(extra["position"]))


def _restore_grad_scaler(parts: Experiment, state: dict[str, Any]) -> None:
    """fp16: the saved loss scale, where the run saved one (a run saved in fp32 or bf16, or
    before scalers were saved, starts from the scaler's initial scale)."""
    saved = state.get("grad_scaler")
    if parts.grad_scaler is not None and saved is not None:
        parts.grad_scaler.load_state_dict(saved)


def _restore_optimizer(parts: Experiment, leaders: list[dict[str, Any]], directory: Path) -> None:
    """This process's optimizer state, gathered by parameter name from the leaders' files."""
    mine = set(parts.names)
    per_name = {
        name: value
        for s in leaders
        for name, value in s["optimizer"]["state"].items()
        if name in mine
    }
    saved_groups = leaders[0]["optimizer"]["param_groups"]
    live_groups = [
        [n for n, p in parts.names.items() if any(p is q for q in g["params"])]
        for g in parts.optimizer.param_groups
    ]
    if len(saved_groups) != len(live_groups):
        raise ConfigError(RESUME, f"{directory}: optimizer parameter groups differ")
    state = {
        "state": per_name,
        "param_groups": [
            {**saved, "params": names}
            for saved, names in zip(saved_groups, live_groups, strict=True)
        ],
    }
    try:
        load_optimizer_state_by_name(parts.optimizer, state, parts.names)
    except (ValueError, KeyError) as err:
        raise ConfigError(RESUME, f"{directory}: optimizer state does not fit ({err})") from err


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a ``.pt`` checkpoint of the earlier format onto the CPU; anything unreadable is a
    ConfigError naming the path."""
    if not path.is_file():
        raise ConfigError(RESUME, f"no checkpoint at {path}")
    state = safe_load(path, RESUME)
    if not isinstance(state, dict) or any(k not in state for k in LEGACY_KEYS):
        raise ConfigError(RESUME, f"{path} is not a giantpipe checkpoint")
    return state


def restore_legacy(parts: Experiment, path: Path, whole: bool = True) -> Progress:
    """Resume from a ``.pt`` file of the earlier format (any balance); ``whole``: this process
    holds the whole model (else: a torchrun rank, which takes its own names)."""
    state = load_checkpoint(path)
    live = parts.pipe.state_dict()
    saved = state["model"] if whole else {k: v for k, v in state["model"].items() if k in live}
    check_model_fits(saved, live, path)
    if parts.ema is not None and state.get("ema") is None:
        raise ConfigError("trainer.ema_decay", f"{path} was saved without an EMA of the weights")
    mine = set(parts.names)
    optimizer = {
        "state": {n: s for n, s in state["optimizer"]["state"].items() if n in mine},
        "param_groups": [
            {**g, "params": [n for n in g["params"] if n in mine]}
            for g in state["optimizer"]["param_groups"]
        ],
    }
    try:
        load_optimizer_state_by_name(parts.optimizer, optimizer, parts.names)
    except (ValueError, KeyError) as err:
        raise ConfigError(RESUME, f"{path}: optimizer state does not fit ({err})") from err
    parts.pipe.load_state_dict({k: v for k, v in state["model"].items() if k in live})
    parts.scheduler.load_state_dict(state["scheduler"])
    if parts.ema is not None:
        parts.ema.load_state_dict({n: t for n, t in state["ema"].items() if n in parts.ema.shadow})
    restore_rng(state["rng"])
    return Progress(step=int(state["step"]), position=int(state["position"]))


def read_checkpoint(directory: Path) -> dict[str, Any]:
    """A checkpoint as one mapping, to look into: ``step``, ``position``, ``model`` (every
    weight, merged), ``ema`` (merged, or None) and the manifest's ``balance`` and ``workers``.

    Example::

        read_checkpoint(Path("outputs/2026-12-01/10-00-00/last"))["step"]   # 120
    """
    extra = run_extra(directory)
    manifest = shards.read_manifest(directory)
    leaders = [_load(directory / extra["state_files"][r]) for r in extra["leader_ranks"]]
    ema = {n: t for s in leaders for n, t in (s["ema"] or {}).items()} if extra["ema"] else None
    return {
        "step": int(extra["step"]),
        "position": int(extra["position"]),
        "model": shards.load(directory),
        "ema": ema,
        "balance": manifest["balance"],
        "workers": manifest["workers"],
    }


# ---- random-number generators: seeded at the start, saved in checkpoints ----------------------


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy's global generator (if numpy is loaded) and torch."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if "numpy" in sys.modules:
        # Only when something already imported numpy: the runner itself does not use it.
        sys.modules["numpy"].random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    """Every generator's state, picklable (tensors on CPU)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        # As plain values (its key array as a list), so checkpoints load with weights_only.
        kind, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` captured (generators absent here are skipped)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
