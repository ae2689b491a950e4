"""Image loaders: a seeded order that workers agree on, a resumable sampler that covers an epoch,
augmentations seeded per image."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from giantpipe.data.images.generated import GeneratedImages
from giantpipe.data.images.loaders import (
    RUN_SIGNALS,
    EpochBatches,
    SeededTransforms,
    build_image_loader,
    loader_options,
    sample_seed,
)
from giantpipe.data.images.transforms import train_transforms


def test_loader_order_is_seeded_and_workers_agree() -> None:
    data = GeneratedImages(size=24, image_size=16, num_classes=4, seed=0)

    def labels(seed: int, workers: int) -> list[int]:
        loader = build_image_loader(
            data, batch_size=8, shuffle=True, num_workers=workers, seed=seed
        )
        return [y for _, batch in loader for y in batch.tolist()]

    assert labels(0, 0) == labels(0, 0)
    assert labels(0, 0) != labels(1, 0)
    assert labels(0, 2) == labels(0, 0)
    images, batch = next(iter(build_image_loader(data, 5, shuffle=False, num_workers=0)))
    assert images.shape == (5, 3, 16, 16) and batch.dtype == torch.int64


def test_epoch_batches_cover_every_image_once_per_epoch_and_resume() -> None:
    batches = list(itertools.islice(iter(EpochBatches(30, 8, seed=1, position=0)), 6))
    first_epoch = [i for batch in batches[:3] for _, i in batch]
    assert len(set(first_epoch)) == 24  # 3 full batches, the last 6 images dropped
    resumed = list(itertools.islice(iter(EpochBatches(30, 8, seed=1, position=4)), 2))
    assert resumed == batches[4:6]
    # The same image gets another augmentation seed in another epoch.
    assert sample_seed(1, 0, 5) != sample_seed(1, 1, 5)


def test_seeded_transforms_repeat_and_leave_the_global_rng_alone(folder: Path) -> None:
    from torchvision.datasets import ImageFolder

    data = SeededTransforms(ImageFolder(folder / "train", train_transforms(24, cutout=8)))
    state = torch.get_rng_state()
    a, _ = data[(123, 0)]
    b, _ = data[(123, 0)]
    c, _ = data[(124, 0)]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), state)


class WorkerSignals(torch.utils.data.Dataset):
    """Each item: the pid of the process that loaded it, and the signals it ignores and blocks
    (the kernel's SigIgn and SigBlk masks: torch's own worker handlers are C handlers, which
    Python's getsignal misses)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        status = dict(
            line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
        )
        return os.getpid(), int(status["SigIgn"], 16), int(status["SigBlk"], 16)


def signals_in(mask: int) -> set[int]:
    return {s for s in RUN_SIGNALS if mask >> (s - 1) & 1}


def test_loader_workers_leave_stop_and_save_signals_to_the_run() -> None:
    """SLURM and `timeout` signal every process of the job: a worker that died of SIGTERM failed
    the run (`DataLoader worker (pid N) is killed by signal: Terminated`) instead of letting the
    training process save and stop (issue 32, item 1)."""
    options = {k: v for k, v in loader_options(num_workers=2, seed=0).items() if k != "collate_fn"}
    for loader in (
        DataLoader(WorkerSignals(), batch_size=4, **options),
        build_image_loader(WorkerSignals(), batch_size=4, shuffle=False, num_workers=2),
    ):
        batches = iter(loader)
        first = list(itertools.islice(batches, 2))  # one from each worker
        workers = {pid for pids, _, _ in first for pid in pids.tolist()}
        assert len(workers) == 2 and os.getpid() not in workers
        for mask in (m for _, ignored, _ in first for m in ignored.tolist()):
            assert signals_in(mask) == set(RUN_SIGNALS) - {signal.SIGTERM}, hex(mask)
        for mask in (m for _, _, blocked in first for m in blocked.tolist()):
            assert signals_in(mask) == {signal.SIGTERM}, hex(mask)
        # SIGTERM from another process (the job's), not from the training process: dropped.
        subprocess.run(["kill", "-TERM", *map(str, workers)], check=True)
        later = [pid for pids, _, _ in itertools.islice(batches, 8) for pid in pids.tolist()]
        assert len(later) == 32 and set(later) == workers  # the same workers
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the main process: its own
        # SIGTERM from the training process (how DataLoader's and multiprocessing's shutdown
        # end a worker, at exit too): the worker ends at once. Ignored, it hung the exit.
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in workers):
            assert time.monotonic() < deadline, "a worker outlived its parent's SIGTERM"
            time.sleep(0.01)


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (neither gone nor a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
