"""Deferred BatchNorm across data-parallel replicas: merged statistics equal one big batch."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from giantpipe.engine.batchnorm import (
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    merge_deferred_batch_norm,
)


def replica_sums(replicas: int) -> list[Callable[[torch.Tensor], None]]:
    """In-place all-reduce sums between threads, one per replica (a stand-in for dist)."""
    barrier, slots = threading.Barrier(replicas), [torch.empty(0)] * replicas

    def for_replica(index: int) -> Callable[[torch.Tensor], None]:
        def all_reduce_sum(tensor: torch.Tensor) -> None:
            slots[index] = tensor.clone()
            barrier.wait()
            total = torch.stack(slots).sum(0)
            barrier.wait()
            tensor.copy_(total)

        return all_reduce_sum

    return [for_replica(i) for i in range(replicas)]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5),
        nn.BatchNorm1d(5, momentum=None),
    )  # fmt: skip


@pytest.mark.parametrize("shares", [(3, 3), (1, 5), (2, 1, 3)])
def test_replicas_commit_the_statistics_of_the_whole_mini_batch(shares: tuple[int, ...]) -> None:
    x = torch.randn(24, 3, 6, 6) * 2 + 0.5
    micro = x.chunk(6)  # six micro-batches of 4, shared unevenly between the replicas
    whole = convert_deferred_batch_norm(model())
    for _ in range(2):  # two steps: the cumulative average (momentum None) counts commits
        for m in micro:
            whole(m)
        commit_deferred_batch_norm(whole)
    replicas = [convert_deferred_batch_norm(model()) for _ in shares]
    starts = [sum(shares[:i]) for i in range(len(shares))]
    for _ in range(2):
        for rep, start, share in zip(replicas, starts, shares, strict=True):
            for m in micro[start : start + share]:
                rep(m)
        sums = replica_sums(len(replicas))
        threads = [
            threading.Thread(target=merge_deferred_batch_norm, args=(rep, fn))
            for rep, fn in zip(replicas, sums, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for rep in replicas:
            commit_deferred_batch_norm(rep)
    for rep in replicas:
        for (name, got), (_, want) in zip(rep.named_buffers(), whole.named_buffers(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


def test_without_pending_statistics_nothing_is_reduced() -> None:
    calls: list[torch.Tensor] = []
    merge_deferred_batch_norm(convert_deferred_batch_norm(model()), calls.append)
    assert calls == []


def test_a_lone_replica_is_unchanged_by_the_merge() -> None:
    x = torch.randn(8, 3, 6, 6)
    a, b = convert_deferred_batch_norm(model()), convert_deferred_batch_norm(model())
    for m in x.chunk(2):
        a(m)
        b(m)
    merge_deferred_batch_norm(a, lambda t: None)  # a group of one: the sum is the tensor
    commit_deferred_batch_norm(a)
    commit_deferred_batch_norm(b)
    for got, want in zip(a.buffers(), b.buffers(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
