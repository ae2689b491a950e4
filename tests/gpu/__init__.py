"""The GPU acceptance tests (marker ``gpu``): what the engine's GPU path must do, as pytest tests.

``python -m pytest -m gpu`` on a GPU machine runs them; without CUDA they skip, unless
``GIANTPIPE_GPU_STANDINS=1`` runs them on CPU stand-ins (``benchmarks/gpu_check.py
--cpu-dry-run``, which also writes the report). Speed and memory measurements are not tests:
they stay in ``benchmarks/gpu_perf.py`` and ``gpu_speed.py``.

- ``test_transparency``: every schedule x re-materialization mode equals the plain model, fp32
  and bf16, and stages on the host and a GPU;
- ``test_fp16_scaler``: fp16 with a gradient scaler steps, skips and scales as the plain model;
- ``test_front_door``: ``y = pipe(x); loss.backward()`` equals the plain model;
- ``test_host_sync``: no synchronising CUDA call inside a step;
- ``test_nccl``: DistributedPipe over NCCL, one rank per GPU, equals the plain model;
- ``case``: their marks (``gpu``, a timeout) and the row each reports; ``conftest``: the run's
  devices (``opts``) and the rows file;
- ``mask_model``, ``steps``, ``errors``: the model, the pipelined and plain steps, the
  tolerances; ``sync``: the host-synchronisation recorders; ``nccl_world``: the ranks' worlds
  (started by tests/support/ranks.py) and test_nccl's rows.
"""
