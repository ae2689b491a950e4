"""Checkpoints of a distributed run: weight shards by un-partitioned names, plus run state.

A checkpoint is a directory (``RUN/last/``, ``RUN/step_N/``) in the layout of
:mod:`giantpipe.engine.dist.shards`, with one more file per rank::

    last/
      manifest.json                          the commit point; extra: step, position, files
      step000000100-3f9c2a-rank00000.pt      weights of rank 0's stage ("0.weight", ...)
      step000000100-3f9c2a-rank00001.pt
      state-step000000100-8b01de-rank00000.pt   rank 0: optimizer (by parameter name), EMA,
      state-step000000100-8b01de-rank00001.pt   LR schedule, RNG, step and data position

Every file goes to a temporary name first; the manifest, replaced last, makes the save count,
and the files of the previous save are removed only after it. Optimizer and EMA state are keyed
by parameter NAME, so a resume under another K (or R) gathers each rank's names from whichever
old files hold them: weights AND optimizer state reshard. RNG states come from the same rank of
the old run where it existed (a rank new to the layout keeps its seeded generator).
``python -m giantpipe.consolidate RUN/last model.pt`` merges the weights for the plain model.

Example::

    save_run(parts, progress, run_dir / "last")            # every rank
    progress = restore_run(parts, run_dir / "last")        # every rank, any K
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.config import ConfigError
from giantpipe.engine.dist import shards
from giantpipe.runner.checkpoint import (
    check_model_fits,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
)
from giantpipe.runner.dist_build import DistributedExperiment
from giantpipe.runner.run_dir import LAST as LOCAL_LAST
from giantpipe.runner.seeding import restore_rng, rng_state
from giantpipe.runner.state import Progress

LAST_DIR = "last"
RUN_FORMAT = "giantpipe-run/1"
KEY = "trainer.resume"


def state_file(tag: str, rank: int) -> str:
    return f"state-{tag}-rank{rank:05d}.pt"


def save_run(parts: DistributedExperiment, progress: Progress, directory: Path) -> None:
    """Collective: every rank writes its run state, then the weight shards and the manifest."""
    pipe, layout = parts.pipe, parts.pipe.layout
    token = [f"step{progress.step:09d}-{secrets.token_hex(3)}"]
    dist.broadcast_object_list(token, src=0, group=pipe.groups.p2p)
    leader = layout.replica == 0  # replicas hold the same optimizer state and EMA
    state = {
        "rank": layout.rank,
        "step": progress.step,
        "position": progress.position,
        "scheduler": parts.scheduler.state_dict(),
        "rng": rng_state(),
        "optimizer": optimizer_state_by_name(parts.optimizer, parts.names) if leader else None,
        "ema": parts.ema.state_dict() if leader and parts.ema is not None else None,
    }
    directory.mkdir(parents=True, exist_ok=True)
    shards.atomic_save(state, directory / state_file(token[0], layout.rank))
    files = [state_file(token[0], r) for r in range(layout.world_size)]
    extra = {
        "format": RUN_FORMAT,
        "step": progress.step,
        "position": progress.position,
        "state_files": files,
        "leader_ranks": list(range(layout.workers)),  # replica 0: optimizer and EMA
        "ema": parts.ema is not None,
    }
    pipe.save_checkpoint(directory, progress.step, extra)  # commits the manifest
    if layout.rank == 0:
        for path in directory.glob("state-*-rank*.pt"):
            if path.name not in files:
                path.unlink(missing_ok=True)


def resume_directory(resume: bool | str, run_dir: Path) -> Path | None:
    """The checkpoint directory to resume from, or None for a fresh run; ConfigError if the
    request cannot be met (checked before anything is written)."""
    last = run_dir / LAST_DIR
    if resume is False:
        for held in (last / shards.MANIFEST, run_dir / LOCAL_LAST):
            if held.exists():
                raise ConfigError(
                    KEY,
                    f"{run_dir} already holds a run ({held.relative_to(run_dir)}); pass "
                    "trainer.resume=true to continue it, or choose another hydra.run.dir",
                )
        return None
    path = last if resume is True else Path(str(resume)).expanduser()
    if path.name == shards.MANIFEST:
        path = path.parent
    if not (path / shards.MANIFEST).is_file():
        hint = (
            " (a local run's file: resume it with pipeline.executor=local)"
            if path.is_file()
            else ""
        )
        raise ConfigError(KEY, f"no distributed checkpoint (manifest.json) at {path}{hint}")
    if (last / shards.MANIFEST).exists() and not last.samefile(path):
        raise ConfigError(
            KEY, f"{run_dir} holds another run's {LAST_DIR}/; resume into a new directory"
        )
    return path


def _read_extra(directory: Path) -> dict[str, Any]:
    try:
        manifest = shards.read_manifest(directory)
    except (OSError, ValueError) as err:
        raise ConfigError(KEY, f"{directory} is not a readable checkpoint ({err})") from err
    extra: dict[str, Any] = manifest.get("extra") or {}
    if extra.get("format") != RUN_FORMAT:
        raise ConfigError(
            KEY,
            f"{directory} holds weights without run state; start a new run from them with "
            "python -m giantpipe.consolidate DIR model.pt and trainer.init_from=model.pt",
        )
    return extra


def _load(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return state


def restore_run(parts: DistributedExperiment, directory: Path) -> Progress:
    """Load weights, optimizer, EMA, LR schedule and RNG for this rank's names (any layout)."""
    extra = _read_extra(directory)
    pipe, rank = parts.pipe, parts.pipe.layout.rank
    live = pipe.state_dict()
    try:
        saved = shards.load(directory, live.keys(), parts.device)
    except KeyError as err:
        raise ConfigError(KEY, f"{directory} does not fit this model ({err.args[0]})") from err
    check_model_fits(saved, live, directory)
    pipe.load_state_dict(saved)
    files = [directory / name for name in extra["state_files"]]
    own = _load(files[rank]) if rank < len(files) else None
    leaders = [_load(files[r]) for r in extra["leader_ranks"]]
    _restore_optimizer(parts, leaders, directory)
    if parts.ema is not None:
        if not extra.get("ema"):
            raise ConfigError("trainer.ema_decay", f"{directory} was saved without an EMA")
        parts.ema.load_state_dict(
            {n: t for s in leaders for n, t in s["ema"].items() if n in parts.ema.shadow}
        )
    parts.scheduler.load_state_dict(leaders[0]["scheduler"])
    if own is not None:
        restore_rng(own["rng"])
    return Progress(step=int(extra["step"]), position=int(extra["position"]))


def _restore_optimizer(
    parts: DistributedExperiment, leaders: list[dict[str, Any]], directory: Path
) -> None:
    """This rank's optimizer state, gathered by parameter name from the old leaders' files."""
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
        raise ConfigError(KEY, f"{directory}: optimizer parameter groups differ")
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
        raise ConfigError(KEY, f"{directory}: optimizer state does not fit ({err})") from err
