"""A run's state in its checkpoints: what the runner saves beside the weights, and puts back.

The checkpoint format itself (files, manifest, DCP, earlier formats) is
:mod:`giantpipe.checkpoint`'s; here is what a run adds to it:

- :mod:`.state`: where the run is (``Progress``), the optimizer's state keyed by parameter name;
- :mod:`.staging`: what one save of this process holds, staged and written;
- :mod:`.model_record`: what the manifest says of the model (its builder, a Hugging Face config);
- :mod:`.writer`: ``CheckpointWriter``, saving in the step or in a background thread;
- :mod:`.restore`: a checkpoint put back into the built parts, under any K, R or executor;
- :mod:`.init_from`: a new run started from another's weights (``trainer.init_from``).
"""
