"""The distributed executor: one process per pipeline rank under torchrun, R replicas of it.

Its modules: :mod:`.pipe` (``DistributedPipe``, a rank's share of the pipeline), :mod:`.layout`
(ranks, stages, replicas and their process groups), :mod:`.p2p` (the transport: the executor's
mailbox across processes), :mod:`.message_order` (the one order of a step's transfers),
:mod:`.wire` (values as bytes, their layouts learned once), :mod:`.replicas` (each stage on FSDP2
over its replicas), :mod:`.clipping` (the global-norm clip), :mod:`.tied` (parameters tied across
ranks), :mod:`.collectives` (a step's collectives under the timeout), :mod:`.faults` (failures
that stop every rank), :mod:`.share` (a rank's share of a model built on meta),
:mod:`.generation` (the generation ring between ranks). How a step runs across ranks:
docs/engine.md#beyond-one-process-distributedpipe; an example: :mod:`.pipe`'s head.

It imports ``torch.distributed``, the rest of :mod:`giantpipe.engine` and, for
``DistributedPipe.save_checkpoint``, the checkpoint format beside it (:mod:`giantpipe.checkpoint`);
nothing in the engine outside this package imports it. The runner and scripts may.
"""
