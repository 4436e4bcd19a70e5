"""Every admin RPC of both services, on real processes: without a token, with a wrong one, and with
the right one. Only the right token gets past authentication, and only it changes anything."""

from __future__ import annotations

import grpc
import pytest
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import data_plane_admin_pb2_grpc as dpa_grpc
from lorafleet.v1 import membership_pb2_grpc as mpb_grpc

from benchmarks.processes import TOKEN
from data_plane.demo_adapters import DEMO_ADAPTERS
from tests.control_plane.conftest import auth
from tests.control_plane.test_auth import CALLS as CONTROL_PLANE_CALLS

pytestmark = pytest.mark.slow
NAME = DEMO_ADAPTERS[1]
# Each DataPlaneAdmin RPC with a request that succeeds when authorised, in an order that makes it succeed.
POD_CALLS = [
    ("LoadAdapter", dpa.LoadAdapterRequest(name=NAME, source=NAME)),
    ("PinAdapter", dpa.PodPinAdapterRequest(name=NAME)),
    ("UnpinAdapter", dpa.PodUnpinAdapterRequest(name=NAME)),
    ("UnloadAdapter", dpa.UnloadAdapterRequest(name=NAME)),
    ("PrefetchAdapter", dpa.PrefetchAdapterRequest(name=NAME, source=NAME)),  # a local source: nothing to fetch
    ("GetState", dpa.GetStateRequest()),
]
assert [n for n, _ in POD_CALLS] != [] and {n for n, _ in POD_CALLS} == set(
    dpa.DESCRIPTOR.services_by_name["DataPlaneAdmin"].methods_by_name)
CREDENTIALS = {"none": (), "wrong": auth("not-" + TOKEN), "right": auth()}


def _code(call, request, metadata) -> grpc.StatusCode:
    try:
        call(request, metadata=metadata, timeout=30)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_admin_rpc_on_both_services_needs_the_right_token(pod, control_plane, results):
    pod_admin = dpa_grpc.DataPlaneAdminStub(pod.channel)
    channel = grpc.insecure_channel(control_plane.target)
    cp_stubs = {"admin": pb_grpc.AdapterAdminStub(channel), "pods": mpb_grpc.PodMembershipStub(channel)}
    calls = [("pod", n, getattr(pod_admin, n), r) for n, r in POD_CALLS] + [
        ("control plane", n, getattr(cp_stubs[s], n), r) for s, n, r in CONTROL_PLANE_CALLS]
    codes: dict[tuple[str, str, str], grpc.StatusCode] = {}
    try:
        for credential in ("none", "wrong"):
            before = (pod.state(), cp_stubs["admin"].ListAdapters(CONTROL_PLANE_CALLS[2][2], metadata=auth()))
            for where, name, call, req in calls:
                codes[where, name, credential] = _code(call, req, CREDENTIALS[credential])
            assert (pod.state(), cp_stubs["admin"].ListAdapters(CONTROL_PLANE_CALLS[2][2], metadata=auth())) == before
        for where, name, call, req in calls:
            codes[where, name, "right"] = _code(call, req, CREDENTIALS["right"])
    finally:
        channel.close()
    refused = {k: v for k, v in codes.items() if k[2] != "right" and v != grpc.StatusCode.UNAUTHENTICATED}
    assert not refused, f"answered without the right token: {refused}"
    failed = {k: v for k, v in codes.items() if k[2] == "right" and v != grpc.StatusCode.OK}
    assert not failed, f"refused with the right token: {failed}"
    results.record(
        "Auth", "admin RPCs on both services",
        f"each of the pod's {len(POD_CALLS)} DataPlaneAdmin RPCs and the control plane's "
        f"{len(CONTROL_PLANE_CALLS)} AdapterAdmin and PodMembership RPCs without a token, with a wrong one, "
        "and with the right one",
        "UNAUTHENTICATED without or with a wrong token, and nothing changed; OK with the right token",
        rpcs=len(calls), calls=len(codes),
        unauthenticated=sum(v == grpc.StatusCode.UNAUTHENTICATED for v in codes.values()),
        ok_with_right_token=sum(v == grpc.StatusCode.OK for k, v in codes.items() if k[2] == "right"))
