"""The weights' exponential moving average (``trainer.ema_decay``), evaluated in place.

The average is kept on each parameter's own device and keyed by the un-partitioned parameter
names, so it checkpoints and resumes like the model does, under any balance.

Example::

    ema = WeightEMA(named_params, decay=0.9999)
    ...; optimizer.step(); ema.update()
    with ema.swapped():           # evaluate with the averaged weights
        evaluate(pipe)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from giantpipe.engine.distributed.replicas import shard_like


class WeightEMA:
    """shadow = decay * shadow + (1 - decay) * weight, after every optimizer step."""

    def __init__(self, params: Mapping[str, nn.Parameter], decay: float) -> None:
        self.params = dict(params)
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, param in self.params.items():
            self.shadow[name].lerp_(param.detach(), 1.0 - self.decay)

    @torch.no_grad()
    def _swap(self) -> None:
        for name, param in self.params.items():
            live = param.detach().clone()
            param.copy_(self.shadow[name])
            self.shadow[name].copy_(live)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Put the averaged weights into the model for the duration of the block."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def state_dict(self) -> dict[str, Tensor]:
        # An FSDP2 shard stays where it is: a save stages it (runner.run_state.staging).
        return {
            name: t.detach() if isinstance(t, DTensor) else t.detach().cpu()
            for name, t in self.shadow.items()
        }

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}")
        for name, tensor in state.items():
            if name in self.shadow:  # a whole tensor for an FSDP2 shard: this rank's part
                self.shadow[name].copy_(shard_like(tensor, self.shadow[name]))
