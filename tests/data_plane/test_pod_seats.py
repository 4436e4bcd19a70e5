"""A pod reports its seats (--max-num-seqs) in its state, so that a router can tell when a new request would wait
for one (router/scoring.py, ``bounded``)."""

from __future__ import annotations

from data_plane.config import DataPlaneConfig
from data_plane.metrics import PodMetrics
from data_plane.pod import build_engine
from data_plane.servicers.admin import pod_state


def test_get_state_and_the_heartbeats_state_report_the_pods_seats(tiny_pod_files):
    model_dir, _, _ = tiny_pod_files
    engine = build_engine(DataPlaneConfig(model=model_dir, max_num_seqs=5, num_kv_blocks=16), PodMetrics())
    assert pod_state(engine, "p", "m", with_prefixes=True).max_num_seqs == 5  # GetState
    assert pod_state(engine, "p", "m").max_num_seqs == 5  # the heartbeat's
