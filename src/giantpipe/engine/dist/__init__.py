"""The distributed executor: one process per pipeline rank under torchrun, R replicas of it.

What lives here: :class:`~giantpipe.engine.dist.pipe.DistributedPipe` (a rank's share of the
pipeline, sharing :class:`giantpipe.engine.base.Pipe` with GPipe), who is who in the world
(:mod:`.layout`), boundary values between ranks (:mod:`.p2p` over the wire format of
:mod:`.wire`), gradients and the other collectives of a step (:mod:`.gradsync`), failures that
stop every rank (:mod:`.faults`), building a model on meta and allocating only a rank's layers
(:mod:`.meta`), and checkpoints sharded by un-partitioned names (:mod:`.shards`).

It imports torch (``torch.distributed``) and the rest of :mod:`giantpipe.engine`; nothing in
the engine outside this package imports it. The runner and scripts may.

Example (``torchrun --nproc_per_node=2 train.py``)::

    from giantpipe.engine.dist.pipe import DistributedPipe, init_distributed

    init_distributed()
    pipe = DistributedPipe(build_model, balance=[4, 4], chunks=8)
    loss = pipe.train_step(x if pipe.needs_inputs else None,
                           y if pipe.needs_targets else None, nn.functional.cross_entropy)
"""
