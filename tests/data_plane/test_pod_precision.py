"""A pod says what precision it computes in: GetState, the heartbeat's state and the metrics carry it."""

from __future__ import annotations

import pytest

from data_plane.config import DataPlaneConfig
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine
from data_plane.servicers.admin import pod_state


@pytest.mark.parametrize(("dtype", "quantization", "reported"), [
    ("float32", "auto", "float32"), ("bfloat16", "auto", "bfloat16"), ("bfloat16-matmul", "auto", "bfloat16-matmul"),
    ("bfloat16", "fp8", "bfloat16+fp8"),  # an FP8 base says so
])
def test_get_state_and_the_metrics_report_the_precision_the_pod_computes_in(tiny_pod_files, dtype, quantization,
                                                                           reported):
    model_dir, _, _ = tiny_pod_files
    metrics = PodMetrics()
    engine = build_engine(DataPlaneConfig(model=model_dir, dtype=dtype, quantization=quantization, num_kv_blocks=16),
                          metrics)
    assert engine.precision == pod_state(engine, "p", "m").precision == reported
    metrics.set_precision(engine.precision)  # as the pod's server does
    assert metrics.registry.get_sample_value("lorafleet_precision_info", {"precision": reported}) == 1


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
