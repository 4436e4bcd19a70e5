"""The router's state refresher against scripted servers on loopback: a control plane that pages its
adapters and lists pods, and pods that answer health and GetState as told."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from lorafleet.v1 import adapter_admin_pb2 as admin_pb
from lorafleet.v1 import adapter_admin_pb2_grpc, data_plane_admin_pb2_grpc
from lorafleet.v1 import data_plane_admin_pb2 as pod_pb

from benchmarks.processes import free_port
from conventions.auth import BearerAuthInterceptor
from router.channels import PodChannels
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.picker import PodPicker
from router.refresher import StateRefresher
from router.view import Tier

TOKEN = "router-test-token"


class ScriptedControlPlane(adapter_admin_pb2_grpc.AdapterAdminServicer):
    """Serves two pages of adapters and the pods it is given."""

    def __init__(self, pods: list[admin_pb.Pod]) -> None:
        self.pods = pods
        self.up = True

    async def ListAdapters(self, request, context):
        if not self.up:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Redis is unreachable")
        if not request.page_token:
            return admin_pb.ListAdaptersResponse(adapters=[admin_pb.Adapter(name="a")], next_page_token="next")
        return admin_pb.ListAdaptersResponse(adapters=[admin_pb.Adapter(
            name="b", placements=[admin_pb.Placement(pod="serving", state=admin_pb.READY, pinned=True)])])

    async def ListPods(self, request, context):
        return admin_pb.ListPodsResponse(pods=self.pods)


class ScriptedPodAdmin(data_plane_admin_pb2_grpc.DataPlaneAdminServicer):
    async def GetState(self, request, context):
        return pod_pb.PodState(slots=pod_pb.TierUsage(capacity=4, used=1), running_requests=2,
                               adapters=[pod_pb.AdapterResidency(name="a", tier=pod_pb.CPU)],
                               precision="bfloat16-matmul")


async def start(servicers, status=None) -> tuple[grpc.aio.Server, str]:
    """A server with the protected services of a lorafleet process; ``status`` sets its health."""
    server = grpc.aio.server(interceptors=[BearerAuthInterceptor(TOKEN, protected=(
        "/lorafleet.v1.AdapterAdmin/", "/lorafleet.v1.DataPlaneAdmin/"))])
    for add, servicer in servicers:
        add(servicer, server)
    if status is not None:
        checker = health.aio.HealthServicer()
        await checker.set("lorafleet.v1.Generation", status)
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


def test_the_view_holds_every_registered_adapter_and_only_ready_serving_pods(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)

    async def go():
        pod_admin = (data_plane_admin_pb2_grpc.add_DataPlaneAdminServicer_to_server, ScriptedPodAdmin())
        serving, serving_at = await start([pod_admin], health_pb2.HealthCheckResponse.SERVING)
        draining, draining_at = await start([pod_admin], health_pb2.HealthCheckResponse.NOT_SERVING)
        pods = [admin_pb.Pod(id="serving", endpoint=serving_at, ready=True),
                admin_pb.Pod(id="draining", endpoint=draining_at, ready=True),
                admin_pb.Pod(id="not-ready", endpoint=serving_at, ready=False),
                admin_pb.Pod(id="gone", endpoint=f"127.0.0.1:{free_port()}", ready=True)]
        cp = ScriptedControlPlane(pods)
        cp_server, cp_at = await start([(adapter_admin_pb2_grpc.add_AdapterAdminServicer_to_server, cp)])
        channels = PodChannels()
        refresher = StateRefresher(RouterConfig(admin_token_file=token_file, control_plane=cp_at,
                                                state_timeout=2.0), TOKEN, channels, RouterMetrics())
        try:
            assert refresher.view is None
            await refresher.refresh()
            first = refresher.view
            cp.up = False  # the last registry stays in use; the pods are still re-read
            await refresher.refresh()
            return first, refresher.view, PodPicker(lambda: refresher.view).choose("b")
        finally:
            await refresher.close()
            await channels.close()
            for server in (serving, draining, cp_server):
                await server.stop(0)

    first, second, ranked = asyncio.run(go())
    assert first.adapters == {"a", "b"}  # both pages
    assert [p.id for p in first.pods] == ["serving"]
    pod = first.pods[0]
    assert (pod.residency, pod.running, pod.slots_total, pod.slots_used, pod.precision) == (
        {"a": Tier.CPU, "b": Tier.DEVICE}, 2, 4, 1, "bfloat16-matmul")
    assert second.adapters == first.adapters and [p.id for p in second.pods] == ["serving"]
    assert second.read_at > first.read_at
    assert [c.pod.id for c in ranked] == ["serving"]
