"""Set-up of a distributed run, all ranks in step: checks, data, model, balance, resume.

Set-up errors are shared (:func:`agree`): a bad key or a missing file on any rank ends the whole
launch in seconds, every rank naming it, instead of leaving the others waiting in a collective.
Rank 0 profiles the balance once and hands it to the others (:func:`from_rank0`).

Example::

    parts, progress, resume_from = setup(cfg, run_dir)      # on every rank, under torchrun
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.data.bundle import DataBundle
from giantpipe.runner.build import build_model
from giantpipe.runner.dist_build import (
    DistributedExperiment,
    build_bundle,
    build_parts,
    check_supported,
    pipeline_ranks,
    plan_balance,
    rank_device,
)
from giantpipe.runner.dist_checkpoint import restore_run, resume_directory
from giantpipe.runner.init_weights import matching, read_weights
from giantpipe.runner.run_dir import check_writable
from giantpipe.runner.seeding import seed_everything
from giantpipe.runner.state import Progress

_T = TypeVar("_T")


def agree(body: Callable[[], _T]) -> _T:
    """Runs ``body`` on every rank and returns its result; if it failed on any rank, every rank
    raises at once (the failed rank its own error), so a set-up error (a bad key, a missing
    file) ends the whole launch in seconds instead of leaving the others in a collective."""
    try:
        result = body()
        error: BaseException | None = None
    except Exception as err:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = err
    texts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, None if error is None else str(error))
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(texts) if text is not None]
    if failed:
        rank, text = failed[0]
        raise RuntimeError(f"rank {rank} failed while setting up: {text}")
    return result


def from_rank0(value: _T) -> _T:
    """Rank 0's ``value`` on every rank (a small picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def init_from(parts: DistributedExperiment, path: Path) -> None:
    """Fine-tune: this rank's tensors of a ``.pt`` file, by name and shape (as the local runner;
    a shard directory: consolidate it first)."""
    live = parts.pipe.state_dict()
    found = matching(read_weights(path), live)
    if not found:
        raise ConfigError("trainer.init_from", f"{path} has no tensor matching this rank's stage")
    parts.pipe.load_state_dict({**live, **found})
    if parts.ema is not None:
        parts.ema.load_state_dict({n: p.detach() for n, p in parts.names.items()})


def setup(
    cfg: ExperimentConfig, run_dir: Path
) -> tuple[DistributedExperiment, Progress, Path | None]:
    """Build this rank's parts, all ranks in step; nothing in ``run_dir`` is written but the
    data builder's files (rank 0 first, the others then reuse them) until all is checked."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def checks() -> tuple[int, Path | None]:
        check_supported(cfg)
        k = pipeline_ranks(cfg.pipeline, world)
        resume_from = resume_directory(cfg.trainer.resume, run_dir)
        if rank == 0:
            check_writable(run_dir)
        return k, resume_from

    k, resume_from = agree(checks)
    device = rank_device(cfg.pipeline)
    seed_everything(cfg.trainer.seed)  # then data, then model: the local runner's order
    bundle = agree(lambda: build_bundle(cfg, run_dir) if rank == 0 else None)

    def model_and_balance() -> tuple[DataBundle, nn.Sequential, list[int] | None]:
        data = bundle or build_bundle(cfg, run_dir)
        model = build_model(cfg)
        balance = plan_balance(cfg, model, data, k, device) if rank == 0 else None
        return data, model, balance

    data, model, balance = agree(model_and_balance)
    balance = from_rank0(balance)  # profiled once, on rank 0
    assert balance is not None
    parts = build_parts(cfg, data, model, balance, device)
    del model  # the other stages' layers go with it

    def restore() -> Progress:
        if resume_from is not None:
            return restore_run(parts, resume_from)
        if cfg.trainer.init_from is not None:
            init_from(parts, Path(cfg.trainer.init_from).expanduser())
        return Progress()

    return parts, agree(restore), resume_from
