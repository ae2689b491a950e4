"""The link probe measures what boundary values cross (issue 21): messages on the device the
transport sends from (``comm_device(pipe.device)``: the GPU under NCCL), on the p2p group, never
a CPU tensor handed to a device group. Sends and receives are recorded, no processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from giantpipe.perf.measured import probe_link


def test_messages_are_made_on_the_links_device(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, torch.device, int, int, Any]] = []

    def record(kind: str) -> Any:
        def op(tensor: torch.Tensor, peer: int, group: Any = None) -> None:
            seen.append((kind, tensor.device, tensor.numel(), peer, group))

        return op

    monkeypatch.setattr(dist, "send", record("send"))
    monkeypatch.setattr(dist, "recv", record("recv"))
    # "meta" stands for a device other than the host's (a GPU): the message must live there.
    seconds = probe_link("<p2p>", 0, 1, 64, rank=1, device=torch.device("meta"), repeats=2)
    assert seconds >= 0.0
    assert [kind for kind, *_ in seen] == ["recv", "send"] * 3  # the receiver answers
    assert {(d.type, n, peer, g) for _, d, n, peer, g in seen} == {("meta", 64, 0, "<p2p>")}
    assert probe_link("<p2p>", 0, 1, 64, rank=2, device="meta") == 0.0  # not on this link
