# Command:  python benchmarks/naive1_activations.py     (~1-2 min on 2 shared cores, no GPU)
# Hardware: any CPU. Real tensors at batch 1 (activations grow linearly with the batch, so
#           every figure is scaled to batch 128); the sizing's own figures under fake tensors.
# Reproduces: why Table 1's Naive-1 AmoebaNet-D (18,208) does not fit here while the paper's
#           does (82M parameters, 6.26 GB of activations at batch 128, 224 px).
"""What autograd saves in one forward of AmoebaNet-D (18,208), layer by layer, and by kind.

For each of the 24 layers of the flat Sequential, the tensors its backward will need are read
off the autograd graph (every node's ``_saved_*`` tensors, one count per storage: a ReLU output
that the next convolution saves too is counted once) and grouped by the op that keeps them:

- ``relu out``: ReLU outputs (PyTorch keeps the result for the mask; the next convolution keeps
  the same storage as its input);
- ``conv out``: convolution outputs, kept by BatchNorm as its input;
- ``pool in``: pooling inputs (max and average pools keep their input) other than the above;
- ``pool idx``: max-pool indices, int64 (8 bytes an element, twice a float);
- ``other``: the image, the classifier, BatchNorm's statistics.

Beside the total, three figures: the sizing's own per-layer ``saved`` bytes
(:func:`giantpipe.perf.stage_memory.profile_layer_memory` on the (9, 208) template under fake
tensors, expanded to 18 layers, as Table 1 sizes Naive-1), a hand calculation of a normal cell
from the genotype, and "one tensor per convolution" (what a compiler that fuses BatchNorm and
ReLU into the convolutions and recomputes them in the backward must keep at least), in float32
and in bfloat16. Writes ``results/table1/naive1_activations.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.testing.outputs import add_output_options, output_path  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_output_options(parser, "table1")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch
from torch import nn

from giantpipe.perf.sizing import template_memory  # noqa: E402
from models.amoebanet import amoebanetd  # noqa: E402
from recipes.model_sizes import AmoebaNetD  # noqa: E402

GIB = 2**30
BATCH, IMAGE, LAYERS, WIDTH = 128, 224, 18, 208
KINDS = ("relu out", "conv out", "pool in", "pool idx", "other")
PAPER_ACTIVATIONS_GB = 6.26  # the paper's Table 1, Naive-1, decimal GB (see the note below)


PRIORITY = {kind: i for i, kind in enumerate(KINDS)}


def _kind(node: torch.autograd.graph.Node, attr: str) -> str:
    name = type(node).__name__
    if name.startswith("Relu"):
        return "relu out"
    if "BatchNorm" in name and attr == "_saved_input":
        return "conv out"
    if "MaxPool" in name and attr == "_saved_result1":  # the indices
        return "pool idx"
    if "Pool" in name and attr == "_saved_self":
        return "pool in"
    return "other"


def _saved(outputs: tuple[torch.Tensor, ...]) -> list[tuple[str, torch.Tensor]]:
    """(kind, tensor) of every tensor the graph behind ``outputs`` keeps for the backward."""
    found: list[tuple[str, torch.Tensor]] = []
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    visited: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed already
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.numel():
                    found.append((_kind(node, attr), t))
        stack += [n for n, _ in node.next_functions if n is not None]
    return found


def saved_by_layer(model: nn.Sequential, image: torch.Tensor) -> list[dict[str, int]]:
    """Bytes each layer's autograd graph keeps, by kind, one count per storage (batch 1).

    Weights and buffers are left out (they are the parameter memory); a storage that several
    ops keep (a ReLU output is the next convolution's input) is counted once, under the kind
    listed first in :data:`KINDS`.
    """
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    counted: set[int] = set()
    out: list[dict[str, int]] = []
    graphs: list[object] = []  # every layer's graph kept alive: a freed address is reused
    h: object = image
    for layer in model:
        inputs = tuple(h) if isinstance(h, tuple) else (h,)
        detached = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
        y = layer(detached if len(detached) > 1 else detached[0])
        outputs = y if isinstance(y, tuple) else (y,)
        best: dict[int, tuple[str, int]] = {}
        for kind, t in _saved(outputs):
            ptr = t.untyped_storage().data_ptr()
            if ptr in weights or ptr in counted:
                continue
            if ptr not in best or PRIORITY[kind] < PRIORITY[best[ptr][0]]:
                best[ptr] = (kind, t.untyped_storage().nbytes())
        kinds: dict[str, int] = defaultdict(int)
        for ptr, (kind, nbytes) in best.items():
            counted.add(ptr)
            kinds[kind] += nbytes
        out.append(dict(kinds))
        graphs.append(y)
        h = tuple(t.detach() for t in outputs) if isinstance(y, tuple) else y.detach()
    return out


def hand_normal_cell(hw: int, channels: int) -> int:
    """Bytes a normal cell (not the first after a reduction) saves for one sample, counted from
    the AmoebaNet-D genotype in C-channel maps of ``hw`` x ``hw`` float32:

    - preprocess0 and preprocess1, ReLU-1x1-BN from 4C to C: ReLU output 4C + conv output C, each;
    - s2 = conv1x1(s1) + maxpool3x3(s1): 2C (ReLU out, conv out) + s1 C + indices 2C;
    - s3 = id(s1) + conv1x7_7x1(s0): the bottleneck keeps ReLU outputs C, C/4, C/4, C/4 and
      conv outputs C/4, C/4, C/4, C: 3.5C;
    - s4 = conv1x1(s0) + conv1x7_7x1(s0): 2C + 3.5C;
    - s5 = maxpool3x3(s2) + id(s2): s2 C + indices 2C;
    - s6 = avgpool3x3(s1) + conv1x1(s5): s1 is kept already; 2C.

    10 + 5 + 3.5 + 5.5 + 3 + 2 = 29 maps of C channels (the concat keeps nothing).
    """
    return int(29 * hw * hw * channels * 4)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out = output_path(args, ROOT, "table1")
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    model = amoebanetd(LAYERS, WIDTH, 1000, IMAGE).train()
    per_layer = saved_by_layer(model, torch.randn(1, 3, IMAGE, IMAGE))
    family = AmoebaNetD(batch=BATCH)
    template = template_memory(family, WIDTH, BATCH, "rmsprop")
    sizing = [template[i].saved for i in family.expand(LAYERS)]
    names = ["stem", "reduce 1 (56 px)", "reduce 2 (28 px)"]
    names += [f"normal {i} (28 px, C={WIDTH})" for i in range(1, 7)]
    names += ["reduce 3 (14 px)"] + [f"normal {i} (14 px, C={2 * WIDTH})" for i in range(7, 13)]
    names += ["reduce 4 (7 px)"] + [f"normal {i} (7 px, C={4 * WIDTH})" for i in range(13, 19)]
    names += ["classifier + loss"]
    rows = ["| layer | " + " | ".join(KINDS) + " | total (GiB) | sizing's saved (GiB) |",
            "|---" * (len(KINDS) + 3) + "|"]  # fmt: skip
    totals: dict[str, float] = defaultdict(float)
    for name, kinds, sized in zip(names, per_layer, sizing):
        cells = [kinds.get(k, 0) * BATCH / GIB for k in KINDS]
        for k, v in zip(KINDS, cells):
            totals[k] += v
        rows.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in cells)
                    + f" | {sum(cells):.2f} | {sized / GIB:.2f} |")  # fmt: skip
    total = sum(totals.values())
    rows.append("| **all 24 layers** | " + " | ".join(f"**{totals[k]:.2f}**" for k in KINDS)
                + f" | **{total:.2f}** | **{sum(sizing) / GIB:.2f}** |")  # fmt: skip
    hand = hand_normal_cell(28, WIDTH) * BATCH / GIB
    walked = sum(per_layer[5].values()) * BATCH / GIB  # normal 3: an ordinary normal cell
    per_conv = totals["conv out"]
    paper_gib = PAPER_ACTIVATIONS_GB * 1e9 / GIB
    notes = [
        f"- Hand calculation of an ordinary normal cell at 28 px, C = {WIDTH}, from the genotype "
        f"(29 maps of C channels a sample, see `hand_normal_cell`): {hand:.3f} GiB at batch "
        f"{BATCH}; read off the graph (normal 3): {walked:.3f} GiB; the sizing: "
        f"{sizing[5] / GIB:.3f} GiB.",
        f"- The paper's Naive-1 activations: {PAPER_ACTIVATIONS_GB} GB = {paper_gib:.2f} GiB "
        f"(the AmoebaNet memory columns are decimal GB: 318M x 12 B = 3.8 GB). PyTorch's "
        f"autograd keeps {total:.2f} GiB, {total / paper_gib:.1f}x as much.",
        f"- Of these, ReLU outputs are {totals['relu out'] / total:.0%} and max-pool int64 "
        f"indices {totals['pool idx'] / total:.0%}: both are what eager PyTorch keeps and a "
        "compiler that fuses BatchNorm and ReLU into the convolutions (as XLA can on TPU) "
        "recomputes in the fused backward instead.",
        f"- One tensor per convolution (its output; BatchNorm, ReLU and the pools' inputs "
        f"recomputed from it in a fused backward): {per_conv:.2f} GiB in float32 "
        f"({total / per_conv:.1f}x less), {per_conv / 2:.2f} GiB in bfloat16 "
        f"({total / (per_conv / 2):.1f}x less): {per_conv / 2 / paper_gib:.2f}x the paper's "
        f"{paper_gib:.2f} GiB. With the pools' inputs kept too (not recomputed): "
        f"{(per_conv + totals['pool in']) / 2:.2f} GiB in bfloat16.",
        "- torchgpipe's PyTorch re-run of this column (batch 128, 224 px, float32, one 24 GB "
        "P40) reports 'Out of memory' (kakaobrain/torchgpipe, docs/benchmarks.rst), as this "
        "count says it must.",
    ]
    text = "\n".join([
        f"# AmoebaNet-D ({LAYERS},{WIDTH}) at batch {BATCH}, {IMAGE} px: what a forward keeps "
        "for the backward",
        "",
        f"Command: `python benchmarks/naive1_activations.py`, "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, load average "
        f"{load:.1f}. GiB at batch {BATCH} (read at batch 1 on real CPU tensors, x {BATCH}); "
        "the last column is the sizing's per-layer `saved` under fake tensors at batch 128.",
        "",
        *rows,
        "",
        *notes,
        "",
    ])  # fmt: skip
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "naive1_activations.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
