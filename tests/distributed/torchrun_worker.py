"""Entry point for torchrun in the distributed tests: runs one function of workers.py.

    python -m torch.distributed.run --nproc_per_node=2 tests/distributed/torchrun_worker.py \
        equivalence /tmp/out '{"workers": 2, "chunks": [2], "modes": ["except_last"]}'

Each rank writes ``result-<rank>.pt`` (``{"ok": True, "result": ...}`` or the traceback) to the
output directory, as the spawn launcher does.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    name, out, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        from giantpipe.engine.distributed.pipe import init_distributed
        from tests.distributed import workers
        from tests.timeouts import scaled

        init_distributed("gloo", timeout=scaled(30.0))
        result = getattr(workers, name)(out, **kwargs)
        torch.save({"ok": True, "result": result}, out / f"result-{rank}.pt")
    except BaseException:  # noqa: BLE001 - reported to the test
        torch.save({"ok": False, "error": traceback.format_exc()}, out / f"result-{rank}.pt")
        raise


if __name__ == "__main__":
    main()
