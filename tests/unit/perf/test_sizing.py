"""perf.sizing: a Table 1 column is a label beside the engine's PipelineSpec (issue 26), and a
sized model carries the spec with its own cut."""

from __future__ import annotations

import dataclasses

from giantpipe.engine.spec import PipelineSpec
from giantpipe.perf.sizing import Setting, measure_size, micro_batch, size_model
from tests.unit.perf.tiny_family import TinyFamily


def test_a_setting_is_a_label_beside_a_pipeline_spec() -> None:
    # and its replicas: K x R devices (one replica unless given)
    assert [f.name for f in dataclasses.fields(Setting)] == ["label", "spec", "replicas"]
    setting = Setting.uncut("Pipeline-2", 2, chunks=4, recompute="always")
    assert isinstance(setting.spec, PipelineSpec)
    assert (setting.spec.num_stages, setting.spec.chunks, setting.spec.recompute) == (
        2, 4, "always")  # fmt: skip
    assert micro_batch(TinyFamily(), setting) == 2
    assert setting.replicas.replicas == 1


def test_a_sized_model_carries_the_spec_with_its_cut() -> None:
    family = TinyFamily()
    setting = Setting.uncut("Pipeline-2", 2, chunks=4, recompute="always")
    size = size_model(family, setting, 6, 16, "rmsprop")
    assert size is not None and isinstance(size.spec, PipelineSpec)
    assert size.spec == setting.spec.replace(balance=size.balance)  # M, mode, schedule kept
    assert sum(size.spec.balance) == 8 and size.spec.num_stages == 2
    stages = measure_size(family, size)  # the engine runs each stage of that spec
    assert len(stages) == 2
    assert sum(s.params for s in stages) == size.params
    assert stages[0].chunks_measured == "2->4"  # M from the spec, extrapolated from M = 2
