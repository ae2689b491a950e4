"""Checkpoints by share: what each of K ranks reads to start from a model's weights, and what
an export holds in memory.

    python benchmarks/checkpoint_share.py            # a Llama of 456 MiB, K=4; exports to 1 GiB
    python benchmarks/checkpoint_share.py --quick    # small sizes, seconds; what the tests run

Load (``trainer.init_from``): a Llama saved as Hugging Face does (``save_pretrained``,
safetensors in 100 MB shards) and as a giantpipe checkpoint one process wrote (one DCP file:
each rank's share lies inside it); K gloo ranks each read their pipeline share (the embedding
with the first layers, the head with the last: ``giantpipe.testing.reads.pipeline_shares``)
through the runner's own read, the files dropped from the page cache first. Per rank: its
share, the bytes it read from disk (``read_bytes``: page-cache misses, mapped pages included,
with the kernel's read-ahead) and through read() (``rchar``: DCP checks each block before it
reads it), and whether every tensor equals a whole load's; then one process reading the whole.

Export (``python -m giantpipe.consolidate``'s own ``main``): checkpoints of N tensors of one
size, N and 4N, exported in a fresh process each (forked from a server that imported the
script's modules once, and run first on a checkpoint of a few KiB of the same kind, so the code
pages it touches, which a fork does not map, are in); the peak of its memory (VmHWM, reset
before the export) above what it held before. ``whole`` is the export as it was before it
streamed: every weight loaded, then saved. The K ranks fork from the same server.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run from a checkout without installing

from giantpipe.testing.outputs import add_output_options, output_path  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    add_output_options(parser, "checkpoints/share.md")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse()  # --help, a bad argument: answered before the imports below load torch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from giantpipe.checkpoint.export import merged  # noqa: E402
from giantpipe.checkpoint.files import atomic_save  # noqa: E402
from giantpipe.checkpoint.names import new_token  # noqa: E402
from giantpipe.checkpoint.save import save_collective  # noqa: E402
from giantpipe.checkpoint.weights import open_weights  # noqa: E402
from giantpipe.consolidate import main as consolidate  # noqa: E402
from giantpipe.testing import free_port, rank_env  # noqa: E402
from giantpipe.testing.held import peak_above_start  # noqa: E402
from giantpipe.testing.reads import (  # noqa: E402
    Layouts,
    digest,
    disk_bytes_read,
    drop_cache,
    pipeline_shares,
    read_my_share,
)

MiB = 2**20


@dataclass(frozen=True)
class Setup:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    ranks: int
    tensor_mib: int
    tensors: int
    """Export: the smaller checkpoint's count of tensors of ``tensor_mib`` (the larger: 4x)."""
    preload: tuple[str, ...] = ()
    """More modules the fork server imports once (every figure is taken after the imports)."""


FULL = Setup(1024, intermediate=2816, layers=8, vocab=8192, ranks=4, tensor_mib=32, tensors=8)
QUICK = Setup(
    128, intermediate=352, layers=4, vocab=1024, ranks=4, tensor_mib=4, tensors=2,
    # what each rank's read of the Hugging Face folder imports (its tied names): in each of the
    # K ranks, that import was most of a quick run's CPU
    preload=("transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama"),
)  # fmt: skip


def save_checkpoint(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """One process's save and commit of ``state`` (a local run's, without the run state)."""
    entry = {"rank": 0, "stages": [0], "names": list(state)}
    meta = {"step": 0, "balance": [1], "schedule": "gpipe", "chunks": 1, "workers": 1}
    meta.update(replicas=1, placement=[0])
    save_collective(directory, new_token(0), state, {}, entry, (meta, {}), None)


def llama(setup: Setup, folder: Path) -> dict[str, torch.Tensor]:
    """A Llama with random weights, saved in ``folder/hf`` (save_pretrained) and
    ``folder/ckpt`` (a giantpipe checkpoint); returns its state dict."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=setup.vocab,
        hidden_size=setup.hidden,
        intermediate_size=setup.intermediate,
        num_hidden_layers=setup.layers,
        num_attention_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder / "hf", max_shard_size="100MB")
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    save_checkpoint(folder / "ckpt", state)
    return state


def _rank(rank: int, world: int, port: int, sources: dict[str, str], shares: list[Layouts],
          out: str) -> None:  # fmt: skip
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for name, source in sources.items():  # one source after the other, each from disk
            torch.save(read_my_share(Path(source), shares), Path(out) / f"{name}{rank}.pt")
    finally:
        dist.destroy_process_group()


def load_rows(setup: Setup, folder: Path, state: dict[str, torch.Tensor]) -> list[str]:
    """Per source and rank: share, read from disk, read(), equal; then a whole load."""
    shares = [
        {n: (state[n].dtype, tuple(state[n].shape)) for n in names}
        for names in pipeline_shares(list(state), setup.ranks)
    ]
    whole = sum(t.nbytes for t in state.values())
    sources = {name: str(folder / name) for name in ("hf", "ckpt")}
    out = folder / "ranks"
    out.mkdir()
    # one start-up of K processes for both sources (read_my_share drops each source's files
    # from the page cache and counts its own reads)
    args = (setup.ranks, free_port(), sources, shares, str(out))
    forkserver(setup)
    mp.start_processes(_rank, args=args, nprocs=setup.ranks, start_method="forkserver")
    rows = []
    for name in sources:
        for rank in range(setup.ranks):
            got = torch.load(out / f"{name}{rank}.pt", weights_only=False)
            equal = all(got["digests"][n] == digest(state[n]) for n in shares[rank])
            rows.append(
                f"| {name} | {rank} | {got['share'] / MiB:.1f} | {got['read'] / MiB:.1f} "
                f"| {got['read'] / got['share']:.2f} | {got['rchar'] / MiB:.1f} | {equal} |"
            )
        drop_cache(folder / name)
        before = disk_bytes_read()
        source = open_weights(folder / name)
        source.read(source.names())
        read = disk_bytes_read() - before
        rows.append(
            f"| {name} | whole, one process | {whole / MiB:.1f} | {read / MiB:.1f} "
            f"| {read / whole:.2f} | | |"
        )
    return rows


EXPORTS = {
    "pt": ("pt", ".pt", 0),
    "safetensors": ("safetensors", ".safetensors", 0),
    "safetensors shards": ("safetensors", "", 2),  # shards of two tensors, and an index
    "whole": ("whole", ".pt", 0),
}
"""An export's name -> its format, the output's suffix (none: a folder), its shards' size in
tensors (0: one file)."""


def forkserver(setup: Setup) -> multiprocessing.context.ForkServerContext:
    """The server the ranks and the exports fork from: it imports this script's modules (and
    the fake tensors' an export brings, and ``setup.preload``) once, where a new interpreter
    each costs seconds of CPU."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch._subclasses.fake_tensor", *setup.preload])
    return context


def export_peak(directory: Path, out: Path, kind: str, shard_bytes: int, warm: Path) -> float:
    """In a fresh process: the export, and its peak memory above the start, in MiB; the
    export of ``warm`` (a few KiB) first, so the code the export runs is mapped in before."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode()  # the modules it brings (about 150 MiB) are the process's, not the model's

    def export(source: Path, to: Path, shard: int) -> None:
        if kind == "whole":  # the export as it was before it streamed
            state, _ = merged(source)
            atomic_save(state, to)
            return
        args = [str(source), str(to), "--format", kind]
        consolidate(args + (["--max-shard-size", str(shard)] if shard else []))

    export(warm, out.with_name(f"warm-{out.name}"), WARM_BYTES if shard_bytes else 0)
    _, peak = peak_above_start(lambda: export(directory, out, shard_bytes))
    return peak / MiB


WARM_BYTES = 1024  # the warm-up checkpoint's tensors, each its own shard


def export_rows(setup: Setup, folder: Path) -> list[str]:
    """Per export and checkpoint size: the export's peak memory above its start."""
    rows = []
    tensor = setup.tensor_mib * MiB
    warm = folder / "export-warm"
    save_checkpoint(warm, {f"{i}.weight": torch.randn(WARM_BYTES // 4) for i in range(3)})
    context = forkserver(setup)
    for count in (setup.tensors, 4 * setup.tensors):
        torch.manual_seed(count)
        state = {f"{i}.weight": torch.randn(tensor // 4) for i in range(count)}
        directory = folder / f"export-{count}"
        save_checkpoint(directory, state)
        del state
        for name, (kind, suffix, shard) in EXPORTS.items():
            out = folder / f"out-{count}{suffix}"
            with ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=1) as fresh:
                peak = fresh.submit(export_peak, directory, out, kind, shard * tensor, warm)
                peak = peak.result()
            rows.append(
                f"| {name} | {count * setup.tensor_mib} | {setup.tensor_mib} | {peak:.1f} "
                f"| {peak / setup.tensor_mib:.2f} |"
            )
            for written in (out, out.with_name(f"warm-{out.name}")):
                if written.is_dir():
                    shutil.rmtree(written)
                else:
                    written.unlink()
    return rows


def report(setup: Setup, folder: Path) -> list[str]:
    load = os.getloadavg()[0]
    state = llama(setup, folder)
    loads = load_rows(setup, folder, state)
    whole = sum(t.nbytes for t in state.values())
    del state
    exports = export_rows(setup, folder)
    return [
        f"# Checkpoints by share ({time.strftime('%Y-%m-%d %H:%M')}, load {load:.1f} -> "
        f"{os.getloadavg()[0]:.1f})",
        "",
        f"## Load: {setup.ranks} ranks read their share of a Llama of {whole / MiB:.0f} MiB "
        f"({setup.layers} layers of width {setup.hidden})",
        "",
        "| source | rank | share (MiB) | read from disk (MiB) | read / share | read() (MiB) "
        "| equal to a whole load |",
        "|---|---|---|---|---|---|---|",
        *loads,
        "",
        f"## Export: peak memory above the start, tensors of {setup.tensor_mib} MiB",
        "",
        "| export | checkpoint (MiB) | largest tensor (MiB) | peak above start (MiB) "
        "| peak / largest tensor |",
        "|---|---|---|---|---|",
        *exports,
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    folder = Path(tempfile.mkdtemp(prefix="giantpipe-share-bench-", dir=args.dir))
    try:
        lines = report(QUICK if args.quick else FULL, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    path = output_path(args, ROOT, "checkpoints/share.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/checkpoint_share.py" + (" --quick" if args.quick else "")
    path.write_text(f"`{command}`\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
