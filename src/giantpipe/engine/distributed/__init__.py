"""The distributed executor: one process per pipeline rank under torchrun, R replicas of it.

What lives here, one concept per module:

- :mod:`.pipe`: :class:`~giantpipe.engine.distributed.pipe.DistributedPipe`, a rank's share of the
  pipeline (sharing :class:`giantpipe.engine.pipe.Pipe` with GPipe);
- :mod:`.layout`: who is who in the world (ranks, stages, replicas) and the process groups;
- :mod:`.wire`: the one wire format of values between ranks (layouts announced, then frames);
- :mod:`.p2p`: the executor's mailbox across processes, frames over gloo;
- :mod:`.message_order`: one agreed order of a step's device operations, from the schedule;
- :mod:`.ordered`: the device transport (NCCL): descriptions on the host, bytes in that order;
- :mod:`.replicas`: each stage spread over its replicas on FSDP2, gathered and reduced per step;
- :mod:`.clipping`: the global-norm clip over every stage and replica's shard;
- :mod:`.tied`: parameters tied across pipeline ranks, their gradients summed once per step;
- :mod:`.collectives`: a step's collectives under the pipe's timeout;
- :mod:`.faults`: failures that stop every rank, named;
- :mod:`.meta`: a model built on meta, only a rank's layers allocated;
- :mod:`.generation`: the generation ring between ranks (a DistributedPipe's link).

It imports torch (``torch.distributed``), the rest of :mod:`giantpipe.engine` and, for
``DistributedPipe.save_checkpoint``, the checkpoint format beside it (:mod:`giantpipe.checkpoint`);
nothing in the engine outside this package imports it. The runner and scripts may.

Example (``torchrun --nproc_per_node=2 train.py``)::

    from giantpipe.engine.distributed.pipe import DistributedPipe, init_distributed

    init_distributed()
    pipe = DistributedPipe(build_model, balance=[4, 4], chunks=8)
    loss = pipe.train_step(x if pipe.needs_inputs else None,
                           y if pipe.needs_targets else None, nn.functional.cross_entropy)
"""
