"""Image loaders: worker processes with a seeded order, and the resumable training stream whose
every augmentation is drawn from (seed, epoch, image index).

The workers leave stop and save signals to the training process (:data:`RUN_SIGNALS`), so a
signal to the whole job lets the run save and stop (docs/your-data.md#image-streams).

Example::

    from giantpipe.data.images.loaders import build_image_loader, train_stream

    loader = build_image_loader(train, batch_size=64, shuffle=True, num_workers=2, seed=0)
    images, labels = next(iter(loader))          # (64, 3, 32, 32) float, (64,) int64
    stream = train_stream(train, batch_size=256, seed=0, position=0, num_workers=8)
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from giantpipe.data.batch_order import epoch_order
from giantpipe.data.bundle import Batch
from giantpipe.data.images.files import BadFiles, Readable, collate_readable

__all__ = [
    "RUN_SIGNALS",
    "EpochBatches",
    "SeededTransforms",
    "build_image_loader",
    "end_on_parents_sigterm",
    "leave_signals_to_the_run",
    "loader_options",
    "sample_seed",
    "train_stream",
]

RUN_SIGNALS = frozenset(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)
"""What stops a run or asks it to save (``trainer.save_signal``): the training process acts on
them at a step boundary; its loader workers leave them to it."""


def leave_signals_to_the_run(worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: leave :data:`RUN_SIGNALS` to the training process.
    SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 are ignored (torch's worker would die of Ctrl-C, of
    SIGUSR1 Python's default action would kill it). SIGTERM stays blocked and a thread of the
    worker takes it (:func:`end_on_parents_sigterm`): from the training process it ends the worker,
    as torch's own worker does (DataLoader's and multiprocessing's shutdown send it), from
    anyone else (the whole job being stopped) it is dropped.

    Example::

        DataLoader(data, num_workers=2, worker_init_fn=leave_signals_to_the_run)
    """
    others = RUN_SIGNALS - {signal.SIGTERM}
    for signum in others:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # for the threads started later
    signal.pthread_sigmask(signal.SIG_UNBLOCK, others)  # held back while it started: now dropped
    threading.Thread(
        target=end_on_parents_sigterm, args=(os.getppid(),), name="giantpipe-sigterm", daemon=True
    ).start()


def end_on_parents_sigterm(parent: int) -> None:
    """Takes the worker's SIGTERM (blocked in every thread): the training process's (``parent``)
    ends the worker at once, with status 0, as torch's own worker handler does; another
    sender's is dropped."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


class HeldSignalsProcess(multiprocessing.context.ForkProcess):
    """A forked process started with :data:`RUN_SIGNALS` blocked in the starting thread: the
    child inherits the mask, so a signal sent to the whole job while it starts waits (in the
    child until :func:`leave_signals_to_the_run` takes it over; in the parent the mask is
    restored at once, and the signal delivered then)."""

    def start(self) -> None:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, RUN_SIGNALS)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


class HeldSignalsContext(multiprocessing.context.ForkContext):
    """The fork start method, its processes started by :class:`HeldSignalsProcess`."""

    Process = HeldSignalsProcess  # type: ignore[assignment]


def worker_context() -> BaseContext | None:
    """The context loader workers start in: :class:`HeldSignalsContext` where processes fork
    (Linux's default), else None (the default start method; a worker then leaves the signals to
    the run from its ``worker_init_fn`` on, and one that comes while it starts may still kill
    it).

    Example::

        DataLoader(data, num_workers=2, multiprocessing_context=worker_context(),
                   worker_init_fn=leave_signals_to_the_run)
    """
    forks = multiprocessing.get_context().get_start_method() == "fork"
    return HeldSignalsContext() if forks else None


def build_image_loader(
    dataset: Dataset[Any],
    batch_size: int,
    shuffle: bool = True,
    num_workers: int = 4,
    seed: int = 0,
    drop_last: bool = False,
) -> DataLoader[Any]:
    """A DataLoader with worker processes, pinned memory on CUDA machines and a seeded
    generator: the same seed gives the same order and the same random augmentations.

    Example::

        loader = build_image_loader(train, batch_size=128, shuffle=True, num_workers=8, seed=0)
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        persistent_workers=num_workers > 0,
        **{**loader_options(num_workers, seed), "collate_fn": None},
    )


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one image's random transforms in one epoch: a hash, so no two collide.

    Example::

        sample_seed(0, epoch=3, index=17)     # the same number on every machine and worker
    """
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class EpochBatches(Sampler[list[tuple[int, int]]]):
    """Endless batches of ``(sample seed, image index)`` from batch ``position`` on.

    Batch ``p`` holds images ``p % per_epoch`` of epoch ``p // per_epoch``'s permutation (the
    one :func:`giantpipe.data.batch_order.epoch_order` gives), the last partial batch dropped.

    Example::

        batches = iter(EpochBatches(size=1000, batch_size=64, seed=0, position=20))
        first = next(batches)           # 64 pairs (seed, index) of batch 20 = epoch 1, batch 5
    """

    def __init__(self, size: int, batch_size: int, seed: int, position: int) -> None:
        if size < batch_size:
            raise ValueError(f"{size} images cannot fill one batch of {batch_size}")
        self.size, self.batch_size, self.seed, self.position = size, batch_size, seed, position

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        per_epoch = self.size // self.batch_size
        epoch, index = divmod(self.position, per_epoch)
        while True:
            order = epoch_order(self.size, self.seed, epoch).tolist()
            for batch in range(index, per_epoch):
                take = order[batch * self.batch_size : (batch + 1) * self.batch_size]
                yield [(sample_seed(self.seed, epoch, i), i) for i in take]
            epoch, index = epoch + 1, 0


class SeededTransforms(Dataset[Any]):
    """Reads ``(sample seed, index)``: the wrapped data set's random transforms draw from the
    torch RNG seeded with the sample seed, so an image's augmentation does not depend on which
    worker loads it or on what ran before. The caller's RNG state is left untouched. An
    unreadable image comes back as a :class:`~giantpipe.data.images.files.BadImage`.

    Example::

        data = SeededTransforms(ImageFolder("data/imagenet/train", train_transforms(224)))
        image, label = data[(1234, 0)]      # the same crop every time
    """

    def __init__(self, data: Dataset[Any]) -> None:
        self.data = Readable(data)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        seed, index = item
        # fork_rng restores the CPU RNG afterwards: loading in the training process
        # (num_workers=0) must not shift the RNG that dropout and drop-path draw from.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.data[index]


def loader_options(num_workers: int, seed: int) -> dict[str, Any]:
    """DataLoader settings of the image bundles: workers that leave stop and save signals to the
    training process, pinned memory on CUDA machines, a seeded generator and the collation that
    passes unreadable images on."""
    # A generator of our own: without one, every new iterator draws its workers' base seed from
    # the global RNG, and a resumed run would draw at another point than an uninterrupted one.
    workers: dict[str, Any] = {}
    if num_workers > 0:
        workers = {
            "multiprocessing_context": worker_context(),
            "worker_init_fn": leave_signals_to_the_run,
        }
    return {
        "num_workers": num_workers,
        "pin_memory": torch.cuda.is_available(),
        "generator": torch.Generator().manual_seed(seed),
        "collate_fn": collate_readable,
        **workers,
    }


def train_stream(
    data: Dataset[Any],
    batch_size: int,
    seed: int,
    position: int,
    num_workers: int,
    files: BadFiles | None = None,
) -> Iterator[Batch]:
    """Endless augmented training batches from batch ``position`` (see :class:`EpochBatches`);
    unreadable images go to ``files`` (default: stop at the first, naming it).

    Example::

        stream = train_stream(train_set, batch_size=256, seed=0, position=0, num_workers=8)
        images, labels = next(stream)
    """
    sampler = EpochBatches(len(data), batch_size, seed, position)  # type: ignore[arg-type]
    loader = DataLoader(
        SeededTransforms(data), batch_sampler=sampler, **loader_options(num_workers, seed)
    )
    return (files or BadFiles(skip=False)).batches(loader)
