"""torchgpipe's front door: ``y = pipe(x); loss.backward()`` runs the pipeline's backward.

:meth:`GPipe.forward <giantpipe.engine.gpipe.GPipe.forward>` runs the forward phase of fill-drain
inside :class:`PipelineFunction`; autograd calls its ``backward`` with the output gradients,
which are scattered to the last stage's mailbox before the backward phase runs::

    forward():   F phase  ->  outputs gathered            (one autograd node for the pipeline)
    backward():  output grads scattered -> B phase -> input grads gathered

Example::

    out = PipelineFunction.apply(pipe, run, fill_drain, started, phony, *inputs)
    out[0].sum().backward()        # the B phase; parameter gradients land in p.grad
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from giantpipe.engine.executor import StepRun
from giantpipe.engine.microbatch import as_tuple, gather, scatter
from giantpipe.engine.schedule import Schedule

if TYPE_CHECKING:
    from giantpipe.engine.gpipe import GPipe


def out_is_tensor(run: StepRun) -> bool:
    """Whether the last stage returned a lone tensor (the front door then unwraps it)."""
    return isinstance(run.results[0], torch.Tensor)


class PipelineFunction(torch.autograd.Function):
    """Autograd bridge of the front door: forward phase now, backward phase on ``backward()``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        pipe: GPipe,
        run: StepRun,
        schedule: Schedule,
        started: float,
        phony: Any,
        *inputs: Any,
    ) -> tuple[torch.Tensor, ...]:
        run.run(schedule.phase("F"))
        pipe._commit_batchnorm()  # the other half of GPipe.forward
        ctx.pipe, ctx.run, ctx.schedule, ctx.started = pipe, run, schedule, started
        ctx.num_inputs = len(inputs)
        out = as_tuple(gather([run.results[m] for m in range(pipe.chunks)]))
        ctx.mark_non_differentiable(*[t for t in out if not t.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        pipe, run = ctx.pipe, ctx.run
        chunks = pipe.chunks
        per_output = [
            scatter(g, chunks) if g is not None else [None] * chunks for g in grad_outputs
        ]
        last = len(pipe.partitions) - 1
        for m in range(chunks):
            run.mailbox.put(("grad", last, m), tuple(col[m] for col in per_output))
        run.run(ctx.schedule.phase("B"))
        pipe._finish(run, ctx.started)
        grads = _gather_input_grads(run, chunks, ctx.num_inputs)
        return (None, None, None, None, None, *grads)


def _gather_input_grads(run: StepRun, chunks: int, num_inputs: int) -> list[Any]:
    grads: list[Any] = []
    for i in range(num_inputs):
        parts = [run.input_grads[m][i] for m in range(chunks)]
        grads.append(None if any(p is None for p in parts) else torch.cat(parts))
    return grads
