"""Where one stage's autograd graph meets the next: leaves in, gradients out, on this thread.

Every stage's graph starts at detached copies of its inputs, so a backward never crosses threads,
devices or processes by itself; :func:`backward_here` keeps a worker's backward on its own thread
(docs/engine-internals.md#autograd-boundaries). The split backward is
:mod:`giantpipe.engine.split_backward`.

Example::

    >>> x = torch.ones(2, requires_grad=True)
    >>> leaf = make_leaves(x * 2, first=False)        # a stage's own graph starts here
    >>> leaf.requires_grad, leaf.grad_fn is None
    (True, True)
"""

from __future__ import annotations

from typing import Any

import torch

from giantpipe.engine.microbatch import TensorOrTensors


def backward_here() -> torch.autograd.set_multithreading_enabled:
    """A context in which autograd runs every backward on the calling thread, every device's
    nodes included (autograd's multithreading off; thread-local, restored on exit).

    The flag travels with each backward's graph task, so the nodes and hooks of a backward
    started inside see it too (``torch.autograd.is_multithreading_enabled()`` is False there).

    Example::

        with backward_here():
            torch.autograd.backward(tensors, grads)   # its CUDA nodes on this thread as well
    """
    return torch.autograd.set_multithreading_enabled(False)


def make_leaves(x: TensorOrTensors, first: bool) -> TensorOrTensors:
    """Detached copies of a stage's inputs, in the same structure (tensor or tuple).

    Float leaves require grad so that the gradient for the previous stage can be read off them;
    on the first stage only where the user's input requires grad (no wasted input gradient).
    The detach is what keeps each stage's graph to itself
    (docs/engine-internals.md#autograd-boundaries).
    """

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        wants = t.requires_grad if first else t.is_floating_point()
        return t.detach().requires_grad_(wants)

    if isinstance(x, torch.Tensor):
        return leaf(x)
    return tuple(leaf(t) for t in x)


def detach(y: Any) -> Any:
    if isinstance(y, torch.Tensor):
        return y.detach()
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in y)


def pair_gradients(
    outputs: tuple[Any, ...], grads: tuple[Any, ...], device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs that need a backward, each with its incoming gradient (None and ints dropped)."""
    if len(outputs) != len(grads):
        raise RuntimeError(
            f"stage returned {len(outputs)} tensors but {len(grads)} gradients came back"
        )
    tensors: list[torch.Tensor] = []
    out_grads: list[torch.Tensor | None] = []
    for y, g in zip(outputs, grads):
        if isinstance(y, torch.Tensor) and y.requires_grad and g is not None:
            tensors.append(y)
            out_grads.append(g.to(device, non_blocking=True))
    return tensors, out_grads


def ones_gradient(t: Any) -> Any:
    """A gradient of ones for a floating-point tensor, None for anything else: what a profile
    feeds a stage's backward in place of its real output gradient."""
    return torch.ones_like(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else None
