"""Checkpoints: one format for both executors, on ``torch.distributed.checkpoint`` (DCP), by
un-partitioned names, committed by a manifest holding every file's hash.

A checkpoint is a directory (``RUN/last/``, ``RUN/step_N/``) in the format of
:mod:`giantpipe.engine.dist.shards`, with the run's state beside the weights::

    last/
      manifest.json                    the commit point: layout, step, data position, the model's
                                       builder, and the size and sha256 of every file below
      step000000100-3f9c2a/            one save (DCP's format)
        .metadata                      DCP's index of the tensors
        __0_0.distcp                   rank 0's tensors: weights ("0.weight"), the optimizer's
                                       ("optimizer/0.weight/exp_avg"), the EMA's ("ema/0.weight")
        __1_0.distcp                   (torchrun: one per rank; a local run writes one)
        state-rank00000.pt             rank 0's run state: LR schedule, fp16's loss scale, RNG,
        state-rank00001.pt             the optimizer's other values and parameter groups

Every file is fsynced under a new folder before the manifest, written last, makes the save
count: a crash at any moment leaves the previous checkpoint whole. Loading checks each file it
reads against the manifest's hash first (a flipped byte or a truncated file is one line naming
it, and the kept ``step_N/`` to resume from instead). Optimizer and EMA state are keyed by
parameter NAME, so a run resumes under another K, R or executor (a torchrun run resumes in one
process and back): every rank reads its names from whichever files hold them. RNG states come
from the same rank where it existed. ``trainer.async_save`` copies the state to host memory in
the step and writes it in a background thread (:class:`CheckpointWriter`).
``python -m giantpipe.consolidate RUN/last model.pt`` merges the weights for the plain model.
The process's random-number generators are seeded once at the start (:func:`seed_everything`)
and their states saved and restored here (:func:`rng_state`, :func:`restore_rng`).

Checkpoints of the earlier formats still load for ``trainer.resume`` (and ``trainer.init_from``:
:func:`load_initial_weights` below): shards and run state as ``.pt`` files beside the manifest
(``giantpipe-shards/1``), and one ``.pt`` holding everything (``last.pt``).

Example::

    save_run(parts, progress, run_dir / "last", world)      # every rank
    progress = restore(parts, run_dir / "last", world)      # any K, R or executor
    read_checkpoint(run_dir / "last")["step"]               # 100
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import logging
import pickle
import random
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from giantpipe.config import ConfigError
from giantpipe.engine.dist import shards
from giantpipe.engine.dist.layout import HOST_BACKEND
from giantpipe.engine.dist.shards import atomic_save
from giantpipe.runner.registry import build_from_target

if TYPE_CHECKING:
    from giantpipe.runner.build import Experiment
    from giantpipe.runner.world import World

__all__ = [
    "CheckpointWriter",
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
OPTIMIZER, EMA = "optimizer/", "ema/"
"""Prefixes of the optimizer's and the EMA's tensors among the weights in DCP's files."""


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


def state_file(rank: int) -> str:
    """A rank's run-state file in a save's folder."""
    return f"state-rank{rank:05d}.pt"


@dataclass
class Staged:
    """One save of this process, ready to write: tensors for DCP (copies in host memory when
    the write runs in the background), the run state, rank 0's manifest fields."""

    step: int
    token: str
    tensors: dict[str, Tensor]
    state: dict[str, Any]
    entry: dict[str, Any] | None
    """This rank's manifest entry (stages, weight names); None on replicas other than 0."""
    commit_as: tuple[dict[str, Any], dict[str, Any]] | None
    """Rank 0: the manifest's layout fields and its run entry (``extra``)."""


def split_optimizer(
    optimizer: torch.optim.Optimizer, names: Mapping[str, nn.Parameter]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The name-keyed optimizer state as DCP tensors (``optimizer/NAME/KEY``) and the rest
    (other values per name, parameter groups), which the run-state file holds."""
    by_name = optimizer_state_by_name(optimizer, names)
    tensors: dict[str, Tensor] = {}
    rest: dict[str, dict[str, Any]] = {}
    for name, values in by_name["state"].items():
        rest[name] = {}
        for key, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"{OPTIMIZER}{name}/{key}"] = value
            else:
                rest[name][key] = value
    return tensors, {"state": rest, "param_groups": by_name["param_groups"]}


def stage(
    parts: Experiment,
    progress: Progress,
    world: World,
    about: dict[str, Any],
    buffers: dict[str, Tensor] | None = None,
    copied: dict[str, Tensor] | None = None,
) -> Staged:
    """Collective (the save's name comes from rank 0): what this process saves. ``buffers``:
    copy every tensor into these host buffers (the step may change the live ones during the
    write); ``copied``: such a copy made earlier in the same step (only a step changes them)."""
    pipe, place = parts.pipe, place_of(parts.pipe)
    token = world.from_rank0(shards.new_token(progress.step))
    leader = place.replica == 0  # replicas hold the same weights, optimizer state and EMA
    tensors: dict[str, Tensor] = {}
    optimizer, entry = None, None
    if leader:
        weights = pipe.state_dict()
        entry = {"rank": place.rank, "stages": list(place.stages), "names": list(weights)}
        opt_tensors, optimizer = split_optimizer(parts.optimizer, parts.names)
        tensors.update({**weights, **opt_tensors})
        if parts.ema is not None:
            tensors.update({f"{EMA}{n}": t for n, t in parts.ema.state_dict().items()})
    state = {
        "rank": place.rank,
        "step": progress.step,
        "position": progress.position,
        "scheduler": parts.scheduler.state_dict(),
        "rng": rng_state(),
        "optimizer": optimizer,
        "ema": None,  # its tensors are DCP's
        # fp16: the loss scale and its growth count, the same on every rank (one verdict)
        "grad_scaler": parts.grad_scaler.state_dict() if parts.grad_scaler is not None else None,
    }
    if copied is not None:
        tensors = copied
    elif buffers is not None:
        tensors = copy_to_host(tensors, buffers)
    else:
        tensors = {k: t.detach().cpu() for k, t in tensors.items()}
    if buffers is not None or copied is not None:
        state = copy.deepcopy(state)
    commit_as = None
    if world.rank == 0:
        commit_as = (_layout(pipe, place, progress.step), _run_entry(parts, progress, world, token))
        commit_as[1]["model"] = about
    return Staged(progress.step, token, tensors, state, entry, commit_as)


def _layout(pipe: Any, place: Place, step: int) -> dict[str, Any]:
    return {
        "step": step,
        "balance": list(pipe.balance),
        "schedule": pipe.schedule,
        "chunks": pipe.chunks,
        "workers": place.workers,
        "replicas": place.replicas,
        "placement": place.placement,
    }


def _run_entry(parts: Experiment, progress: Progress, world: World, token: str) -> dict[str, Any]:
    replicas = place_of(parts.pipe).replicas
    return {
        "format": RUN_FORMAT,
        "step": progress.step,
        "position": progress.position,
        "state_files": [f"{token}/{state_file(r)}" for r in range(world.size)],
        "leader_ranks": list(range(world.size // replicas)),  # replica 0's ranks
        "ema": parts.ema is not None,
    }


def copy_to_host(tensors: dict[str, Tensor], buffers: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` copied into ``buffers`` (host memory, kept from save to save: a fresh 1 GiB
    costs the kernel a quarter of a million page faults every time, here slower than the copy;
    pinned for a GPU's tensors, so the copies run asynchronously and at full speed)."""
    copies = {}
    for name, tensor in tensors.items():
        buffer = buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            buffers[name] = buffer
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        copies[name] = buffer
    for name in set(buffers) - set(tensors):
        del buffers[name]
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()  # the copies are done before the step changes the tensors
    return copies


def write_staged(staged: Staged, directory: Path, group: Any) -> None:
    """Collective over ``group`` (None: one process): writes ``staged`` into ``directory``
    and commits it there (rank 0)."""
    rank = staged.state["rank"]
    objects = {state_file(rank): staged.state}
    directory.mkdir(parents=True, exist_ok=True)
    shards.save_collective(
        directory, staged.token, staged.tensors, objects, staged.entry, staged.commit_as, group
    )


def host_group(pipe: Any, world: World) -> Any:
    """The gloo group of every rank that saves run on (None in a world of one)."""
    return pipe.groups.control if world.size > 1 else None


def save_run(
    parts: Experiment,
    progress: Progress,
    directory: Path,
    world: World,
    about: dict[str, Any] | None = None,
) -> None:
    """Collective: every rank writes its run state, replica 0 its tensors; rank 0 commits.
    ``about``: what the manifest says of the model (:func:`model_record`)."""
    staged = stage(parts, progress, world, about or {})
    write_staged(staged, directory, host_group(parts.pipe, world))


class BackgroundSaveError(RuntimeError):
    """A checkpoint written in the background failed; ``cause`` says why (reported at the next
    save or at the end of the run, never lost)."""

    def __init__(self, directory: Path, step: int, cause: BaseException) -> None:
        super().__init__(
            f"the checkpoint of step {step} could not be written to {directory} "
            f"({type(cause).__name__}: {cause})"
        )
        self.directory, self.step, self.cause = directory, step, cause


class CheckpointWriter:
    """Saves a run's checkpoints, in the step or (``asynchronous``) in a background thread.

    Asynchronous: the step waits only for the copy of the state to host memory (buffers kept
    for the run: one more copy of the state in host memory); a thread writes the files and
    commits them, while training goes on. Our own thread rather than
    ``dcp.async_save``: the commit (hashing every file, then the manifest) must follow the
    write in the background too, and one code path then serves both modes. Saves of the same
    step (``step_N/`` then ``last/``) share one copy of the tensors and queue behind it; a
    save of another step, and :meth:`wait`, wait for the previous ones and raise their
    failure (BackgroundSaveError).
    Under torchrun the thread's collectives run on a gloo group of their own, so they never
    mix with the step's.

    Example::

        writer = CheckpointWriter(world, asynchronous=True, on_commit=print)
        writer.save(parts, progress, run_dir / "last")     # returns after the copy
        writer.wait()                                      # the write is committed
    """

    def __init__(
        self,
        world: World,
        asynchronous: bool = False,
        on_commit: Callable[[Path, int], None] | None = None,
    ) -> None:
        self.world, self.asynchronous = world, asynchronous
        self.on_commit = on_commit or (lambda directory, step: None)
        self._job: _Job | None = None
        self._group: Any = None
        self._buffers: dict[str, Tensor] = {}
        """Host copies of the tensors, reused by every asynchronous save of the run."""

    def save(
        self,
        parts: Experiment,
        progress: Progress,
        directory: Path,
        about: dict[str, Any] | None = None,
    ) -> None:
        """Saves ``parts`` at ``progress`` into ``directory`` (collective)."""
        job, about = self._job, about or {}
        if job is not None and job.step == progress.step:  # the same tensors: the same copy
            job.add(directory, stage(parts, progress, self.world, about, copied=job.tensors))
            return
        self.wait()
        buffers = self._buffers if self.asynchronous else None
        staged = stage(parts, progress, self.world, about, buffers)
        if not self.asynchronous:
            write_staged(staged, directory, host_group(parts.pipe, self.world))
            self.on_commit(directory, progress.step)
            return
        self._job = _Job(staged, self._background_group(parts.pipe), self.on_commit)
        self._job.add(directory, staged)
        self._job.start()

    def wait(self) -> None:
        """Returns once the save in flight (if any) is committed; raises its failure."""
        job, self._job = self._job, None
        if job is None:
            return
        job.close()
        job.join()
        if job.failure is not None:
            failed, step = job.failed_at or Path("?"), job.step
            if isinstance(job.failure, KeyboardInterrupt):
                raise job.failure
            raise BackgroundSaveError(failed, step, job.failure) from job.failure

    def _background_group(self, pipe: Any) -> Any:
        if self.world.size == 1:
            return None
        if self._group is None:  # every rank reaches its first save at the same step
            timeout = datetime.timedelta(seconds=float(pipe.timeout))
            self._group = dist.new_group(backend=HOST_BACKEND, timeout=timeout)
        return self._group


class _Job(threading.Thread):
    """Writes the saves of one step handed to it, in order, until closed."""

    def __init__(self, staged: Staged, group: Any, on_commit: Callable[[Path, int], None]):
        super().__init__(name="giantpipe-checkpoint", daemon=True)  # Ctrl-C twice: stop at once
        self.step, self.tensors = staged.step, staged.tensors
        self.group, self.on_commit = group, on_commit
        self.failure: BaseException | None = None
        self.failed_at: Path | None = None
        self._todo: list[tuple[Path, Staged]] = []
        self._closed = False
        self._ready = threading.Condition()

    def add(self, directory: Path, staged: Staged) -> None:
        with self._ready:
            self._todo.append((directory, staged))
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()

    def run(self) -> None:
        while True:
            with self._ready:
                while not self._todo and not self._closed:
                    self._ready.wait()
                if not self._todo:
                    return
                directory, staged = self._todo.pop(0)
            if self.failure is not None:
                continue  # every rank failed the same save together: all skip the rest
            try:
                write_staged(staged, directory, self.group)
                self.on_commit(directory, self.step)
            except BaseException as err:  # noqa: BLE001 - reported by CheckpointWriter.wait
                self.failure, self.failed_at = err, directory


# -- what the manifest says of the model -------------------------------------------------------


def model_record(spec: Any, model: nn.Module | None) -> dict[str, Any]:
    """The model's builder (``_target_``) and, for a Hugging Face model, its config as JSON
    (what ``python -m giantpipe.consolidate ... --format hf`` writes as ``config.json``).

    Example::

        model_record(cfg.model, parts.model)   # {"target": "models.hf.hf_causal_lm", ...}
    """
    record: dict[str, Any] = {"target": str(getattr(spec, "_target_", ""))}
    config = hf_config(spec, model)
    if config is not None:
        record["hf_config"] = config
    return record


def hf_config(spec: Any, model: nn.Module | None) -> dict[str, Any] | None:
    """The Hugging Face config of the model ``spec`` builds, or None for any other model.

    The capture keeps the weights, not the Hugging Face module, so the builder runs again, on
    the meta device (no memory, no weights) and with the random generators put back after.
    A flat Sequential as built is never a Hugging Face model; nor is anything built where
    transformers was never imported.
    """
    if "transformers" not in sys.modules:
        return None
    if isinstance(model, nn.Sequential) and not hasattr(model, "original_names"):
        return None
    try:
        with _generators_kept(), torch.device("meta"):
            built = build_from_target(spec, "model")
    except Exception:  # noqa: BLE001 - a builder that needs real memory: no export as hf
        return None
    config: Any = getattr(built, "config", None)
    if not hasattr(config, "to_json_string") or not hasattr(built, "save_pretrained"):
        return None
    found: dict[str, Any] = json.loads(config.to_json_string())
    return found


@contextlib.contextmanager
def _generators_kept() -> Iterator[None]:
    saved = rng_state()
    try:
        yield
    finally:
        restore_rng(saved)


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


def _load(directory: Path, name: str, manifest: dict[str, Any]) -> Any:
    """A run-state file of the checkpoint, checked against the manifest's hash first."""
    shards.verify(directory, manifest, [name])
    return safe_load(directory / name, RESUME, mmap=True)


def kept_beside(directory: Path) -> Path | None:
    """The newest other checkpoint of the same run (``step_N/`` beside ``directory``) whose
    manifest reads, to offer when ``directory`` is damaged."""
    here = directory.resolve()
    numbered = [p for p in here.parent.glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    for path in sorted(numbered, key=lambda p: int(p.name[5:]), reverse=True):
        if path.resolve() == here:
            continue
        try:
            shards.read_manifest(path)
        except (OSError, ValueError):
            continue
        return directory.parent / path.name
    return None


def refusal(err: shards.CheckpointDamaged, directory: Path, key: str = RESUME) -> ConfigError:
    """One line: the damaged file, and what to do (resume from a kept ``step_N/``)."""
    kept = kept_beside(directory)
    if kept is not None:
        verb = "resume" if key == RESUME else "start"
        return ConfigError(key, f"{err}; {verb} from {kept} with {key}={kept}")
    return ConfigError(
        key,
        f"{err}; nothing was removed, and no other checkpoint is kept beside it "
        "(trainer.checkpoint_every keeps step_N/ copies)",
    )


@contextlib.contextmanager
def refusing_damage(directory: Path, key: str = RESUME) -> Iterator[None]:
    """A damaged file read inside becomes :func:`refusal`'s ConfigError."""
    try:
        yield
    except shards.CheckpointDamaged as err:
        raise refusal(err, directory, key) from err


def read_run(directory: Path, key: str = RESUME) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint directory's manifest and its run entry; ConfigError naming ``key``."""
    try:
        with refusing_damage(directory, key):
            manifest = shards.read_manifest(directory)
    except (OSError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(key, f"{directory} is not a readable checkpoint ({err})") from err
    extra: dict[str, Any] = manifest.get("extra") or {}
    if extra.get("format") != RUN_FORMAT:
        raise ConfigError(
            key,
            f"{directory} holds weights without run state; start a new run from them with "
            "python -m giantpipe.consolidate DIR model.pt and trainer.init_from=model.pt",
        )
    return manifest, extra


def run_extra(directory: Path, key: str = RESUME) -> dict[str, Any]:
    """The run state's entry in a checkpoint directory's manifest; ConfigError naming ``key``."""
    return read_run(directory, key)[1]


def restore(parts: Experiment, path: Path, world: World) -> Progress:
    """Load a checkpoint (a directory, or a ``.pt`` file of the earlier format) into the built
    parts; ConfigError naming trainer.resume if it does not fit or a file is damaged."""
    if path.is_dir():
        with refusing_damage(path):
            return restore_run(parts, path, world.rank)
    return restore_legacy(parts, path, whole=world.size == 1)


def restore_run(parts: Experiment, directory: Path, rank: int) -> Progress:
    """Weights, optimizer, EMA, LR schedule and RNG for this process's names (any layout)."""
    manifest, extra = read_run(directory)
    live = parts.pipe.state_dict()
    if parts.ema is not None and not extra.get("ema"):
        raise ConfigError("trainer.ema_decay", f"{directory} was saved without an EMA")
    wanted = list(live)
    if manifest["format"] != shards.OLD_FORMAT:  # the optimizer's and EMA's tensors: DCP's
        held = shards.tensor_names(directory)
        mine = {f"{OPTIMIZER}{n}/" for n in parts.names}
        wanted += [k for k in held if k.startswith(OPTIMIZER) and k.rsplit("/", 1)[0] + "/" in mine]
        shadow = parts.ema.shadow if parts.ema is not None else {}
        wanted += [f"{EMA}{n}" for n in shadow]
    try:
        loaded = shards.load(directory, wanted)
    except KeyError as err:
        raise ConfigError(RESUME, f"{directory} does not fit this model ({err.args[0]})") from err
    saved = {n: loaded[n] for n in live}
    check_model_fits(saved, live, directory)
    files = list(extra["state_files"])
    leaders = [_load(directory, files[r], manifest) for r in extra["leader_ranks"]]
    _restore_optimizer(parts, leaders, directory, loaded)
    parts.pipe.load_state_dict(saved)
    if parts.ema is not None:
        ema = {n[len(EMA) :]: t for n, t in loaded.items() if n.startswith(EMA)}
        ema = ema or {n: t for s in leaders for n, t in s["ema"].items()}  # the earlier format
        parts.ema.load_state_dict({n: t for n, t in ema.items() if n in parts.ema.shadow})
    parts.scheduler.load_state_dict(leaders[0]["scheduler"])
    _restore_grad_scaler(parts, leaders[0])
    if rank < len(files):  # a rank new to the layout keeps its seeded generators
        restore_rng(_load(directory, files[rank], manifest)["rng"])
    return Progress(step=int(extra["step"]), position=int(extra["position"]))


def _restore_grad_scaler(parts: Experiment, state: dict[str, Any]) -> None:
    """fp16: the saved loss scale, where the run saved one (a run saved in fp32 or bf16, or
    before scalers were saved, starts from the scaler's initial scale)."""
    saved = state.get("grad_scaler")
    if parts.grad_scaler is not None and saved is not None:
        parts.grad_scaler.load_state_dict(saved)


def _restore_optimizer(
    parts: Experiment, leaders: list[dict[str, Any]], directory: Path, tensors: dict[str, Tensor]
) -> None:
    """This process's optimizer state, gathered by parameter name from the leaders' files and
    (``optimizer/NAME/KEY``) from ``tensors``."""
    mine = set(parts.names)
    per_name = {
        name: dict(value)
        for s in leaders
        for name, value in s["optimizer"]["state"].items()
        if name in mine
    }
    for key, tensor in tensors.items():
        if key.startswith(OPTIMIZER):
            name, slot = key[len(OPTIMIZER) :].rsplit("/", 1)
            per_name.setdefault(name, {})[slot] = tensor
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


def read_checkpoint(directory: Path, key: str = RESUME) -> dict[str, Any]:
    """A checkpoint as one mapping, to look into: ``step``, ``position``, ``model`` (every
    weight, merged), ``ema`` (merged, or None) and the manifest's ``balance`` and ``workers``.
    Every file read is checked against the manifest's hashes first; a refusal names ``key``
    (the setting that asked for the checkpoint).

    Example::

        read_checkpoint(Path("outputs/2026-12-01/10-00-00/last"))["step"]   # 120
    """
    with refusing_damage(directory, key):
        manifest, extra = read_run(directory, key)
        model = shards.load(directory)
        ema = None
        if extra["ema"] and manifest["format"] == shards.OLD_FORMAT:
            files = extra["state_files"]
            leaders = [_load(directory, files[r], manifest) for r in extra["leader_ranks"]]
            ema = {n: t for s in leaders for n, t in (s["ema"] or {}).items()}
        elif extra["ema"]:
            names = [n for n in shards.tensor_names(directory) if n.startswith(EMA)]
            ema = {n[len(EMA) :]: t for n, t in shards.load(directory, names).items()}
    return {
        "step": int(extra["step"]),
        "position": int(extra["position"]),
        "model": model,
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


# Fine-tuning: a new run from another run's weights (trainer.init_from).
#
# Fine-tuning: start a run from another run's weights (``trainer.init_from=PATH``).
#
# The GPipe paper's transfer experiments start from the ImageNet model and replace its softmax for
# the new data set's classes. Here every tensor of the checkpoint whose name and shape match the
# new model is loaded; the rest (the classifier of another class count) keep the fresh
# initialization the builder gave them. The optimizer, the learning-rate schedule, the step and
# the data position start anew: this is a new run, not a resume. PATH is a checkpoint directory
# (its EMA of the weights when it kept one, with the model's buffers), a shard directory of
# ``DistributedPipe.save_checkpoint``, a ``.pt`` checkpoint of the earlier format, or a plain
# ``state_dict`` file. Under torchrun each rank loads its own stage's tensors.
#
# Example::
#
#     python train.py recipe=amoebanet_quickstart trainer.max_steps=100        # writes last/
#     python train.py recipe=amoebanet_quickstart trainer.init_from=outputs/.../last \
#         data.num_classes=5

log = logging.getLogger(__name__)
INIT = "trainer.init_from"


def read_weights(path: Path) -> dict[str, Tensor]:
    """Name -> tensor from a checkpoint (its EMA when it kept one), a shard directory or a
    plain ``state_dict`` file; anything else is a ConfigError naming trainer.init_from.

    Example::

        weights = read_weights(Path("outputs/2026-11-30/14-26-42/last"))
    """
    if path.is_dir():
        if not (path / shards.MANIFEST).is_file():
            raise ConfigError(INIT, f"no checkpoint (manifest.json) in {path}")
        with refusing_damage(path, INIT):
            extra = shards.read_manifest(path).get("extra") or {}
            if extra.get("format") == RUN_FORMAT:
                state = read_checkpoint(path, INIT)
                return {**state["model"], **(state["ema"] or {})}
            return shards.load(path)
    if not path.is_file():
        raise ConfigError(INIT, f"no checkpoint at {path}")
    loaded: Any = safe_load(path, INIT)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("model"), Mapping):
        weights = dict(loaded["model"])
        if isinstance(loaded.get("ema"), Mapping):
            weights.update(loaded["ema"])
        loaded = weights
    if not isinstance(loaded, Mapping) or not loaded:
        raise ConfigError(INIT, f"{path} holds no state dict (a name -> tensor mapping)")
    return {str(k): v for k, v in loaded.items() if isinstance(v, Tensor)}


def matching(saved: Mapping[str, Tensor], live: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The saved tensors whose name and shape the live model has.

    Example::

        matching({"fc.weight": torch.zeros(1000, 64)}, {"fc.weight": torch.zeros(10, 64)})  # {}
    """
    return {
        name: tensor
        for name, tensor in saved.items()
        if name in live and tuple(live[name].shape) == tuple(tensor.shape)
    }


def load_initial_weights(parts: Experiment, path: Path) -> list[str]:
    """Load the matching tensors of ``path`` into the built run; return the names left fresh.

    The GPipe paper's transfer experiments start from the ImageNet model and replace its
    softmax: every tensor whose name and shape match is loaded, the rest (a classifier of
    another class count) keep their fresh initialization; optimizer, step and data position
    start anew. A one-line ConfigError when nothing matches (another model, or a path to the
    wrong run). The EMA, if any, restarts from the loaded weights.
    """
    live = parts.pipe.state_dict()
    saved = read_weights(path)
    found = matching(saved, live)
    if not found:
        raise ConfigError(
            INIT,
            f"{path} has no tensor matching this model by name and shape (checkpoint: "
            f"{sorted(saved)[:2]}..., model: {sorted(live)[:2]}...)",
        )
    parts.pipe.load_state_dict({**live, **found})
    if parts.ema is not None:
        parts.ema.load_state_dict({n: p.detach() for n, p in parts.names.items()})
    fresh = sorted(set(live) - set(found))
    log.info(
        "init_from %s: loaded %d of %d tensors; freshly initialized: %s",
        path,
        len(found),
        len(live),
        ", ".join(fresh) if fresh else "none",
    )
    return fresh
