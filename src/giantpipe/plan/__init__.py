"""The planner: the best balance, micro-batch count, re-materialization mode and schedule for a
model on K devices, chosen by simulation.

    python -m giantpipe.plan --model amoebanet-d --layers 18 --filters 256 --devices 8 \\
        --memory-gib 16 --batch 512 --peak-tflops 125 --bandwidth-gbps 50

From Python (what ``pipeline.plan=auto`` in the runner can call)::

    from giantpipe.plan import DeviceSpec, measure_layers, plan

    layers = measure_layers(model_on_meta, one_sample_on_meta)  # FLOPs and bytes per layer
    device = DeviceSpec(peak_flops=125e12, memory_bytes=16 * 2**30, link_bandwidth=50e9)
    candidates = plan(layers, num_devices=8, batch_size=512, device=device)
    best = candidates[0]
    pipe = GPipe(model, best.balance, devices=..., chunks=best.chunks,
                 checkpoint=best.checkpoint, schedule=best.schedule,
                 virtual_stages=best.virtual_stages)

``plan`` returns every configuration that fits in memory, fastest first; each
:class:`Candidate` carries its predicted step time, samples/s, bubble, peak memory per device
and the :class:`~giantpipe.perf.simulate.Simulation` (``plot_timeline`` draws it). What goes in:
per-layer FLOPs and bytes measured on the meta device (:mod:`giantpipe.plan.costs`), a device
model (:class:`DeviceSpec`: peak FLOP/s x efficiency + a per-layer overhead, memory, link), the
optimizer's state per parameter, and each schedule's in-flight activations. What is left out:
the backward's transient workspace and allocator fragmentation (``DeviceSpec.reserve`` keeps
10% of memory for them), and kernel efficiency that varies with shape.
"""

from giantpipe.plan.costs import LayerCost, measure_layers
from giantpipe.plan.search import Candidate, DeviceSpec, plan

__all__ = ["Candidate", "DeviceSpec", "LayerCost", "measure_layers", "plan"]
