"""Least privilege between components, on real processes: a control plane with three tokens (admin, reader,
pod), one pod that knows only the pod token and the reader token, and a router holding the reader token.
The fleet works (heartbeats, a pin loaded, a request routed); the reader token reads but cannot register,
pin, load or unload anything; a pod takes commands only with the control plane's token; each refusal is
PERMISSION_DENIED for a known token of the wrong role and UNAUTHENTICATED for one the server does not know."""

from __future__ import annotations

import grpc
import pytest
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import data_plane_admin_pb2_grpc as dpa_grpc
from lorafleet.v1 import membership_pb2_grpc as mpb_grpc

from benchmarks.processes import TOKEN, Fleet, RouterProcess, copy_demo_adapters, wait_until
from conventions.auth import bearer_metadata
from tests.control_plane.test_auth import CALLS as CONTROL_PLANE_CALLS
from tests.grpc_helpers import request
from tests.reliability.test_auth import POD_CALLS

pytestmark = pytest.mark.slow
READER, POD = "reader-token-of-the-tests", "pod-token-of-the-tests"
READS = {"GetAdapter", "ListAdapters", "ListPods", "Route", "GetState"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("roles")
    (workdir / "reader").write_text(READER + "\n")
    (workdir / "pod").write_text(POD + "\n")
    fleet = Fleet(workdir, copy_demo_adapters(tmp_path_factory.mktemp("roles-adapters")), "--admin-token-file",
                  str(workdir / "pod"), "--reader-token-file", str(workdir / "reader"), pods=1,
                  control_plane_args=("--reader-token-file", str(workdir / "reader"), "--pod-token-file",
                                      str(workdir / "pod")))
    router = None
    try:
        fleet.start()  # the pod registered: its heartbeats carry the pod token
        fleet.register("pirate")
        fleet.pin("pirate", 1)
        wait_until(lambda: fleet.placements("pirate"), 60, "pirate loaded by the control plane's pod token")
        router = RouterProcess(workdir, fleet.cp.target, workdir / "reader", "--refresh-interval", "0.3",
                               token_flag="--reader-token-file").start()
        yield fleet, router
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


def codes(fleet: Fleet, token: str) -> dict[tuple[str, str], grpc.StatusCode]:
    """Every AdapterAdmin, PodMembership and DataPlaneAdmin RPC's code with ``token``, Heartbeat aside (the pod's
    own heartbeats show the pod token's; a test's would add a pod that is not there)."""
    pod = next(iter(fleet.pods.values()))
    stubs = {"admin": pb_grpc.AdapterAdminStub(fleet.channel), "pods": mpb_grpc.PodMembershipStub(fleet.channel),
             "pod": dpa_grpc.DataPlaneAdminStub(pod.channel)}
    calls = [(s, n, r) for s, n, r in CONTROL_PLANE_CALLS if n != "Heartbeat"] + [
        ("pod", n, r) for n, r in POD_CALLS]
    out = {}
    for service, name, req in calls:
        try:
            getattr(stubs[service], name)(req, metadata=bearer_metadata(token), timeout=30)
            out[service, name] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            out[service, name] = e.code()
    return out


def pod_state(fleet: Fleet) -> dpa.PodState:
    pod = next(iter(fleet.pods.values()))
    return dpa_grpc.DataPlaneAdminStub(pod.channel).GetState(dpa.GetStateRequest(), metadata=bearer_metadata(READER),
                                                             timeout=10)


def test_the_router_serves_with_the_reader_token(fleet):
    _, router = fleet
    wait_until(lambda: router.metric("lorafleet_router_pods_routable") == 1, 10, "the pod read with the reader token")
    last = list(router.generation().Generate(request("Ahoy?", "pirate", max_tokens=2), timeout=120))[-1]
    assert last.usage.completion_tokens == 2


def test_the_reader_token_reads_and_can_change_nothing(fleet):
    fleet, _ = fleet
    fleet.admin().RegisterAdapter(CONTROL_PLANE_CALLS[0][2], metadata=fleet.auth(), timeout=10)  # for the reads
    before = (pod_state(fleet).adapters, fleet.adapter("pirate"), fleet.adapter("a"))
    got = codes(fleet, READER)
    fleet.admin().UnregisterAdapter(pb.UnregisterAdapterRequest(name="a"), metadata=fleet.auth(), timeout=10)
    assert {k for k, v in got.items() if v == grpc.StatusCode.OK} == {k for k in got if k[1] in READS}
    assert {v for k, v in got.items() if k[1] not in READS} == {grpc.StatusCode.PERMISSION_DENIED}
    assert (pod_state(fleet).adapters, fleet.adapter("pirate"), before[2]) == before


def test_a_pod_takes_commands_only_with_the_control_planes_token(fleet):
    fleet, _ = fleet
    before = pod_state(fleet).adapters
    admin = codes(fleet, TOKEN)  # the admin token: the control plane's writer, unknown to the pod
    assert {v for k, v in admin.items() if k[0] == "pod"} == {grpc.StatusCode.UNAUTHENTICATED}
    assert {v for k, v in admin.items() if k[0] == "pods"} == {grpc.StatusCode.PERMISSION_DENIED}
    assert {v for k, v in admin.items() if k[0] == "admin"} == {grpc.StatusCode.OK}
    assert pod_state(fleet).adapters == before
    pod = codes(fleet, POD)  # the control plane's token to its pods: commands pass, the admin API does not
    assert {v for k, v in pod.items() if k[0] == "admin"} == {grpc.StatusCode.PERMISSION_DENIED}
    # Past the gate, each command is the pod's to judge: one made by hand carries no leader's fencing token, so
    # it is ABORTED (stale), not refused for its credential; the pin the control plane loaded with this token
    # shows the commands work.
    assert {k[1]: v for k, v in pod.items() if k[0] == "pod"} == {
        **{n: grpc.StatusCode.ABORTED for n, _ in POD_CALLS}, "GetState": grpc.StatusCode.OK}


def test_reads_and_writes_are_told_apart_in_the_words_of_the_refusal(fleet):
    fleet, _ = fleet
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.AdapterAdminStub(fleet.channel).PinAdapter(pb.PinAdapterRequest(name="pirate", replicas=1),
                                                            metadata=bearer_metadata(READER), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "(reader) may not call /lorafleet.v1.AdapterAdmin/PinAdapter" in e.value.details()
    assert "admin token" in e.value.details()
