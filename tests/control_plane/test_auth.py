"""Every AdapterAdmin and PodMembership RPC needs the bearer token; health and reflection do not."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa
from lorafleet.v1 import membership_pb2 as mpb
from lorafleet.v1 import membership_pb2_grpc as mpb_grpc

from benchmarks.processes import TOKEN
from control_plane.errors import ConfigError
from conventions.auth import read_token
from conventions.tls import Dialer
from data_plane.membership import MembershipClient
from tests.control_plane.conftest import auth, serving

SHA = "0123456789abcdef" * 4

# Each RPC with a request that succeeds when authorised, in an order that makes it succeed.
CALLS = [
    ("admin", "RegisterAdapter", pb.RegisterAdapterRequest(name="a", source="file:///x/a", sha256=SHA)),
    ("admin", "GetAdapter", pb.GetAdapterRequest(name="a")),
    ("admin", "ListAdapters", pb.ListAdaptersRequest(page_size=10)),
    ("admin", "PinAdapter", pb.PinAdapterRequest(name="a", replicas=1)),
    ("admin", "UnpinAdapter", pb.UnpinAdapterRequest(name="a")),
    ("admin", "ListPods", pb.ListPodsRequest()),
    ("admin", "Route", pb.RouteRequest(adapter="a")),
    ("pods", "Heartbeat", mpb.HeartbeatRequest(pod_id="pod-0", endpoint="127.0.0.1:1", ready=True,
                                               state=dpa.PodState(slots=dpa.TierUsage(capacity=4)))),
    ("pods", "ResolveAdapter", mpb.ResolveAdapterRequest(name="a")),
    ("admin", "UnregisterAdapter", pb.UnregisterAdapterRequest(name="a")),
]
assert {n for _, n, _ in CALLS} == set(pb.DESCRIPTOR.services_by_name["AdapterAdmin"].methods_by_name) | set(
    mpb.DESCRIPTOR.services_by_name["PodMembership"].methods_by_name)

BAD_CREDENTIALS = {
    "no metadata": (),
    "empty token": (("authorization", "Bearer "),),
    "wrong token": auth("not-the-token"),
    "token prefix": auth(TOKEN[:-1]),
    "token with suffix": auth(TOKEN + "x"),
    "basic scheme": (("authorization", f"Basic {TOKEN}"),),
    "bare token": (("authorization", TOKEN),),
}


async def call_all(channel, metadata) -> dict[str, grpc.StatusCode]:
    stubs = {"admin": pb_grpc.AdapterAdminStub(channel), "pods": mpb_grpc.PodMembershipStub(channel)}
    codes = {}
    for service, method, request in CALLS:
        try:
            await getattr(stubs[service], method)(request, metadata=metadata, timeout=10)
            codes[method] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            codes[method] = e.code()
            assert e.code() != grpc.StatusCode.UNAUTHENTICATED or "token" in e.details() or "credentials" in e.details()
    return codes


@pytest.mark.parametrize("credentials", list(BAD_CREDENTIALS), ids=list(BAD_CREDENTIALS))
def test_every_rpc_without_the_right_token_is_unauthenticated_and_changes_nothing(config, credentials):
    async def go():
        async with serving(config) as channel:
            codes = await call_all(channel, BAD_CREDENTIALS[credentials])
            listed = await pb_grpc.AdapterAdminStub(channel).ListPods(pb.ListPodsRequest(), metadata=auth())
            return codes, listed

    codes, listed = asyncio.run(go())
    assert codes == {m: grpc.StatusCode.UNAUTHENTICATED for _, m, _ in CALLS}
    assert list(listed.pods) == []  # the refused heartbeat did not join the fleet


def test_every_rpc_with_the_right_token_succeeds(config):
    async def go():
        async with serving(config) as channel:
            return await call_all(channel, auth())

    assert asyncio.run(go()) == {m: grpc.StatusCode.OK for _, m, _ in CALLS}


def test_health_needs_no_token_and_reports_serving_once_redis_answers(config):
    async def go():
        async with serving(config) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(50):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="lorafleet.v1.AdapterAdmin"))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return reply.status
                await asyncio.sleep(0.1)
            return reply.status

    assert asyncio.run(go()) == health_pb2.HealthCheckResponse.SERVING


def test_health_is_not_serving_while_redis_is_down(config, redis_server):
    redis_server.kill()

    async def go():
        async with serving(config) as channel:
            await asyncio.sleep(0.3)
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            try:
                await pb_grpc.AdapterAdminStub(channel).ListPods(pb.ListPodsRequest(), metadata=auth(), timeout=10)
            except grpc.aio.AioRpcError as e:
                return reply.status, e.code()

    assert asyncio.run(go()) == (health_pb2.HealthCheckResponse.NOT_SERVING, grpc.StatusCode.UNAVAILABLE)


def test_token_file_must_hold_one_token(tmp_path):
    path = tmp_path / "t"
    path.write_text("  \n")
    with pytest.raises(ConfigError, match="must hold one token"):
        read_token(path)
    path.write_text("two tokens\n")
    with pytest.raises(ConfigError, match="without spaces"):
        read_token(path)
    path.write_text("tok\n")
    assert read_token(path) == "tok"


def test_tls_serves_both_services_and_still_requires_the_token(config, tls_files):
    cert, key = tls_files
    config = dataclasses.replace(config, tls_cert=cert, tls_key=key)

    async def go():
        from control_plane.server import serve

        stop = asyncio.Event()
        task = asyncio.create_task(serve(config, stop))
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        client = MembershipClient(f"127.0.0.1:{config.port}", TOKEN, "pod-0", "127.0.0.1:1", "", dpa.PodState,
                                  dialer=Dialer(cert.read_bytes()))
        try:
            async with grpc.aio.secure_channel(f"127.0.0.1:{config.port}", creds) as channel:
                await asyncio.wait_for(channel.channel_ready(), timeout=10)
                admin = pb_grpc.AdapterAdminStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await admin.ListPods(pb.ListPodsRequest(), metadata=auth("wrong"))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await client.heartbeat()
                return [p.id for p in (await admin.ListPods(pb.ListPodsRequest(), metadata=auth())).pods]
        finally:
            await client.close()
            stop.set()
            await asyncio.wait_for(task, timeout=15)

    assert asyncio.run(go()) == ["pod-0"]
