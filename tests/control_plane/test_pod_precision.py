"""A pod's precision travels from its heartbeat into its record and out of ListPods, and a record written
before pods reported one still reads."""

from __future__ import annotations

import json

from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import membership_pb2 as mpb

from control_plane.admin_service import pod_pb
from control_plane.fleet import PodView
from control_plane.membership_service import pod_record
from control_plane.records import PodRecord


def test_the_heartbeats_precision_is_the_records_and_list_pods_shows_it():
    beat = mpb.HeartbeatRequest(pod_id="p", endpoint="10.0.0.1:50051", base_model="m", ready=True,
                                state=dpa.PodState(precision="bfloat16-matmul"))
    record = pod_record(beat)
    assert record.precision == "bfloat16-matmul"
    assert pod_pb(PodView(record, ready=True)).precision == "bfloat16-matmul"


def test_a_record_without_a_precision_reads_as_not_reported():
    stored = json.loads(PodRecord("p", "10.0.0.1:50051").to_json())
    del stored["precision"]  # as a control plane before this field wrote it
    assert PodRecord.from_json(json.dumps(stored)).precision == ""
