"""How far a pipelined step is from the plain model's: relative errors and the two tolerances.

fp32: every tensor within float noise of reordered sums (:data:`FP32_TOL`). Low precision
(bf16, fp16): both are judged against the plain model in fp32, and the pipe's error may be at
most :data:`LOW_PRECISION_FACTOR` times the plain model's own low-precision error.

Example::

    ok, measured = fp32_verdict(pipe_step(pipe, inputs, target), ref)   # True, '5.6e-08 (loss)'
"""

from __future__ import annotations

import math

import torch

from tests.gpu.steps import Outcome

FP32_TOL = 1e-5  # relative error of any tensor, pipelined against plain, fp32
LOW_PRECISION_FACTOR = 1.5  # bf16/fp16: the pipe's error vs fp32 at most 1.5x the plain model's
FP32_CRITERION = f"every tensor within {FP32_TOL:.0e} relative of the plain model's"
LOW_CRITERION = f"error vs fp32 <= {LOW_PRECISION_FACTOR}x the plain model's, every tensor"


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (integer tensors: 0 if equal, else 1); a NaN is infinitely
    wrong (a NaN would compare as neither larger nor smaller than a tolerance).

    >>> relative(torch.tensor([1.0, float("nan")]), torch.ones(2))
    inf
    """
    if not b.is_floating_point():
        return 0.0 if torch.equal(a.cpu(), b.cpu()) else 1.0
    a64, b64 = a.double().cpu(), b.double().cpu()
    value = float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))
    return math.inf if math.isnan(value) else value


def errors(got: Outcome, ref: Outcome) -> dict[str, float]:
    """The relative error of every tensor of ``got`` against ``ref``, by name (``loss``,
    ``grad:<param>``, ``buffer:<name>``, ``outputs``); a missing gradient counts as 1."""
    out = {"loss": relative(got.loss, ref.loss)}
    for name, g in ref.grads.items():
        out[f"grad:{name}"] = relative(got.grads[name], g) if name in got.grads else 1.0
    for name, b in ref.buffers.items():
        out[f"buffer:{name}"] = relative(got.buffers[name], b) if name in got.buffers else 1.0
    if ref.outputs is not None:
        out["outputs"] = relative(got.outputs, ref.outputs) if got.outputs is not None else 1.0
    return out


def worst(errs: dict[str, float]) -> tuple[str, float]:
    """The name and value of the largest error.

    >>> worst({"loss": 1e-7, "grad:0.weight": 3e-6})
    ('grad:0.weight', 3e-06)
    """
    name = max(errs, key=lambda n: errs[n])
    return name, errs[name]


def worst_ratio(pipe: dict[str, float], plain: dict[str, float]) -> tuple[str, float]:
    """The tensor whose pipelined error (against fp32) exceeds the plain model's the most,
    as the smallest factor F with pipe <= F * plain + 1e-6."""
    ratios = {
        n: (e - 1e-6) / plain[n] if plain[n] > 0 else (0.0 if e <= 1e-6 else float("inf"))
        for n, e in pipe.items()
    }
    return worst(ratios)


def fp32_verdict(got: Outcome, ref: Outcome) -> tuple[bool, str]:
    """``got`` against the fp32 reference ``ref``: within :data:`FP32_TOL`, and what was
    measured (the worst tensor)."""
    name, err = worst(errors(got, ref))
    return err <= FP32_TOL, f"{err:.1e} ({name})"


def low_precision_verdict(got: Outcome, ref: Outcome, low: Outcome) -> tuple[bool, str]:
    """``got`` against the fp32 reference ``ref`` by the factor rule, ``low`` being the plain
    model in the same low precision."""
    pipe_errs, plain_errs = errors(got, ref), errors(low, ref)
    name, factor = worst_ratio(pipe_errs, plain_errs)
    measured = f"{factor:.2f}x ({name}: {pipe_errs[name]:.1e} vs {plain_errs[name]:.1e})"
    return factor <= LOW_PRECISION_FACTOR, measured
