"""A pod says what precision it computes in: GetState, the heartbeat's state and the metrics carry it."""

from __future__ import annotations

import pytest

from data_plane.config import DataPlaneConfig
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine
from data_plane.servicers.admin import pod_state


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-matmul"])
def test_get_state_and_the_metrics_report_the_precision_the_pod_computes_in(tiny_pod_files, dtype):
    model_dir, _, _ = tiny_pod_files
    metrics = PodMetrics()
    engine = build_engine(DataPlaneConfig(model=model_dir, dtype=dtype, num_kv_blocks=16), metrics)
    assert pod_state(engine, "p", "m").precision == dtype
    metrics.set_precision(engine.model.precision.value)
    assert metrics.registry.get_sample_value("lorafleet_precision_info", {"precision": dtype}) == 1


def test_auto_reports_what_it_resolved_to_and_one_precision_only(tiny_pod_files):
    model_dir, _, _ = tiny_pod_files
    metrics = PodMetrics()
    engine = build_engine(DataPlaneConfig(model=model_dir, num_kv_blocks=16), metrics)
    reported = pod_state(engine, "p", "m").precision
    assert reported in ("float32", "bfloat16-matmul")  # on CPU: float32 weights, projections as measured
    metrics.set_precision("float32")
    metrics.set_precision(reported)
    samples = [s for m in metrics.registry.collect() if m.name == "lorafleet_precision_info" for s in m.samples]
    assert [(s.labels["precision"], s.value) for s in samples] == [(reported, 1.0)]
