"""Where the GPU checks run: the CUDA devices of this machine, or CPU stand-ins (a dry run).

``tests/gpu`` and ``benchmarks/gpu_*.py`` read one :class:`GpuOptions` from the environment
that ``benchmarks/gpu_check.py`` sets per case: ``GIANTPIPE_GPU_STANDINS=1`` (CPU stand-ins at
tiny sizes), ``GIANTPIPE_GPU_QUICK=1`` (the short budget's sizes), ``GIANTPIPE_GPU_INJECT``
(a planted ``hang`` or ``wrong`` weight, to prove the check reports it) and
``GIANTPIPE_GPU_TIMEOUT`` (every ceiling, :func:`ceiling`).

>>> opts = GpuOptions.from_env({"GIANTPIPE_GPU_STANDINS": "1"})
>>> opts.dry, opts.gpus, opts.devices()
(True, 0, [device(type='cpu'), device(type='cpu')])
>>> GpuOptions.from_env(opts.env()) == opts
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STANDINS, QUICK, INJECT = "GIANTPIPE_GPU_STANDINS", "GIANTPIPE_GPU_QUICK", "GIANTPIPE_GPU_INJECT"
TIMEOUT = "GIANTPIPE_GPU_TIMEOUT"  # seconds per test or measurement, overriding its own
ROWS = "GIANTPIPE_GPU_ROWS"  # a file the GPU tests append their rows to (tests/gpu/conftest.py)
DRY_TIMEOUT_S = 90.0  # per test or measurement on CPU stand-ins (2 shared cores)
QUICK_TIMEOUT = 0.5  # the short budget: each GPU timeout halved, so one hang fits the budget
INJECTIONS = ("hang", "wrong")  # test-only faults: a stage that never returns, a wrong weight
CUDA_ONLY, TWO_GPUS = "CUDA only", "needs 2 GPUs"  # verdicts: what this run cannot judge


def ceiling(gpu_seconds: float, env: Mapping[str, str] | None = None) -> float:
    """The timeout of a test or measurement whose ceiling on a GPU is ``gpu_seconds``: halved
    at the quick sizes, :data:`DRY_TIMEOUT_S` on CPU stand-ins, unless ``$GIANTPIPE_GPU_TIMEOUT``
    says otherwise (a ceiling only a hang reaches: several times what it should take).

    >>> ceiling(120.0, {}), ceiling(120.0, {QUICK: "1"}), ceiling(120.0, {STANDINS: "1"})
    (120.0, 60.0, 90.0)
    """
    env = os.environ if env is None else env
    if env.get(TIMEOUT):
        return float(env[TIMEOUT])
    if env.get(STANDINS) == "1":
        return DRY_TIMEOUT_S
    return gpu_seconds * (QUICK_TIMEOUT if env.get(QUICK) == "1" else 1.0)


@dataclass(frozen=True)
class GpuOptions:
    """One run of the GPU checks, as every test and measurement sees it."""

    dry: bool  # CPU stand-ins and tiny sizes
    quick: bool  # the short budget (fewer rounds, smaller models)
    gpus: int  # CUDA devices visible to the run (0 in a dry run)
    inject: str | None = None  # test-only fault: "hang" stalls a stage, "wrong" perturbs a weight

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GpuOptions:
        """The run ``env`` (default: this process's environment) asks for; the GPUs counted
        unless it is a dry run."""
        env = os.environ if env is None else env
        dry = env.get(STANDINS, "") == "1"
        inject = env.get(INJECT) or None
        if inject is not None and inject not in INJECTIONS:
            raise ValueError(f"{INJECT}={inject!r}: expected one of {INJECTIONS}")
        if dry:
            gpus = 0
        else:
            import torch  # here, not above: gpu_check.py reads INJECTIONS before torch loads

            gpus = torch.cuda.device_count()
        return cls(dry=dry, quick=env.get(QUICK, "") == "1", gpus=gpus, inject=inject)

    def env(self) -> dict[str, str]:
        """The environment variables that make a child process see these options."""
        out = {STANDINS: "1" if self.dry else "0", QUICK: "1" if self.quick else "0"}
        return {**out, INJECT: self.inject or ""}

    @property
    def workers(self) -> int:
        """K: 2 (on one GPU both share it), 4 when four GPUs are there."""
        return 4 if self.gpus >= 4 else 2

    def devices(self, k: int | None = None) -> list[torch.device]:
        """One device per worker: CPU stand-ins, or the GPUs in turn (shared when too few)."""
        import torch

        k = self.workers if k is None else k
        if self.dry:
            return [torch.device("cpu")] * k
        return [torch.device("cuda", w % self.gpus) for w in range(k)]

    @property
    def device(self) -> torch.device:
        """Where the plain model runs: the first worker's device."""
        return self.devices(1)[0]
