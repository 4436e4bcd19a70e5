"""The real control-plane process against a real Redis, over gRPC on 127.0.0.1."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa

from benchmarks.processes import BASE_MODEL, REPO, TOKEN, ControlPlaneProcess
from control_plane.server import SERVICES
from control_plane.store import Store
from conventions.health import LIVENESS
from data_plane.errors import AdapterNotFound
from data_plane.membership import MembershipClient
from tests.control_plane.conftest import auth

pytestmark = pytest.mark.slow
SHA = "0123456789abcdef" * 4
LEASE_S, GRACE_S = 1.0, 1.0


@pytest.fixture
def start_control_plane(redis_server, token_file, tmp_path):
    started: list[ControlPlaneProcess] = []

    def start(replica: str = "r1", port: int | None = None) -> ControlPlaneProcess:
        cp = ControlPlaneProcess(redis_server.url, token_file, tmp_path, replica, port).start()
        started.append(cp)
        return cp

    yield start
    for cp in started:
        cp.stop(signal.SIGKILL)


def pod_state() -> dpa.PodState:
    return dpa.PodState(pod_id="pod-a", base_model=BASE_MODEL, slots=dpa.TierUsage(capacity=4, used=1),
                        cpu_cache=dpa.TierUsage(capacity=8, used=1),
                        adapters=[dpa.AdapterResidency(name="style", tier=dpa.CPU, rank=8, sha256=SHA, slot=-1)])


def membership(cp: ControlPlaneProcess) -> MembershipClient:
    return MembershipClient(cp.target, TOKEN, "pod-a", "127.0.0.1:7001", BASE_MODEL, pod_state, interval_s=0.2)


async def eventually(predicate, timeout_s: float, what: str):
    """Polls ``predicate`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def register(name: str) -> pb.RegisterAdapterRequest:
    return pb.RegisterAdapterRequest(name=name, source=f"file:///adapters/{name}", sha256=SHA, base_model=BASE_MODEL)


def test_adapter_lifecycle_over_grpc(start_control_plane):
    cp = start_control_plane()

    async def go():
        async with grpc.aio.insecure_channel(cp.target) as channel:
            admin = pb_grpc.AdapterAdminStub(channel)
            created = await admin.RegisterAdapter(register("style"), metadata=auth())
            assert (created.version, created.base_model, created.pinned) == (1, BASE_MODEL, False)
            assert await admin.GetAdapter(pb.GetAdapterRequest(name="style"), metadata=auth()) == created

            for i in range(6):
                await admin.RegisterAdapter(register(f"extra-{i}"), metadata=auth())
            names, token, pages = [], "", 0
            while True:
                page = await admin.ListAdapters(pb.ListAdaptersRequest(page_size=3, page_token=token), metadata=auth())
                names += [a.name for a in page.adapters]
                pages, token = pages + 1, page.next_page_token
                if not token:
                    break
            assert names == sorted(names) and len(names) == 7 and pages == 3

            pinned = await admin.PinAdapter(pb.PinAdapterRequest(name="style", replicas=2), metadata=auth())
            assert (pinned.pinned, pinned.pin_replicas, pinned.version) == (True, 2, 2)
            status = await eventually(
                lambda: _pin_status(admin, "style"), 5, "the unsatisfiable pin to be reported")
            assert status == "asked for 2 pods, pinned on 0: no ready pods"
            unpinned = await admin.UnpinAdapter(pb.UnpinAdapterRequest(name="style", expected_version=2),
                                                metadata=auth())
            assert (unpinned.pinned, unpinned.version, unpinned.pin_status) == (False, 3, "")

            await admin.UnregisterAdapter(pb.UnregisterAdapterRequest(name="style"), metadata=auth())
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await admin.GetAdapter(pb.GetAdapterRequest(name="style"), metadata=auth())
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(go())
    assert cp.metric("lorafleet_control_plane_redis_up") == 1.0
    assert cp.stop() == 0  # SIGTERM drains and exits cleanly


async def _pin_status(admin, name: str) -> str:
    return (await admin.GetAdapter(pb.GetAdapterRequest(name=name), metadata=auth())).pin_status


def test_a_heartbeating_pod_is_listed_and_disappears_after_its_lease_and_grace(start_control_plane):
    cp = start_control_plane()

    async def go():
        client = membership(cp)
        async with grpc.aio.insecure_channel(cp.target) as channel:
            admin = pb_grpc.AdapterAdminStub(channel)
            await admin.RegisterAdapter(register("style"), metadata=auth())
            beating = asyncio.create_task(client.run())

            async def listed():
                return [p for p in (await admin.ListPods(pb.ListPodsRequest(), metadata=auth())).pods if p.ready]

            pods = await eventually(listed, 5, "the pod to be listed ready")
            assert (pods[0].id, pods[0].endpoint, pods[0].slots_total, list(pods[0].adapters)) == (
                "pod-a", "127.0.0.1:7001", 4, ["style"])
            route = await admin.Route(pb.RouteRequest(adapter="style"), metadata=auth())
            assert [(p.pod, p.state) for p in route.placements] == [("pod-a", pb.READY)]
            assert (await admin.GetAdapter(pb.GetAdapterRequest(name="style"), metadata=auth())).rank == 8

            assert await client.resolve("style") == ("file:///adapters/style", SHA)
            with pytest.raises(AdapterNotFound, match="not registered"):
                await client.resolve("unknown")
            await eventually(lambda: client.guard.newest > 0, 5, "the pod to learn the fencing token")

            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
            stopped = time.monotonic()

            async def gone():
                return not (await admin.ListPods(pb.ListPodsRequest(), metadata=auth())).pods

            await eventually(gone, LEASE_S + GRACE_S + 3, "the pod to be removed")
            assert time.monotonic() - stopped >= LEASE_S + GRACE_S - 0.3

    asyncio.run(go())


def test_a_control_plane_restart_loses_nothing_and_pods_keep_heartbeating(start_control_plane):
    cp = start_control_plane()

    async def go():
        client = membership(cp)
        beating = asyncio.create_task(client.run())
        async with grpc.aio.insecure_channel(cp.target) as channel:
            admin = pb_grpc.AdapterAdminStub(channel)
            for name in ("a", "b", "c"):
                await admin.RegisterAdapter(register(name), metadata=auth())
            await admin.PinAdapter(pb.PinAdapterRequest(name="b", replicas=0), metadata=auth())
            before = await admin.ListAdapters(pb.ListAdaptersRequest(), metadata=auth())

        cp.stop(signal.SIGKILL)
        restarted = start_control_plane("r1-again", port=cp.port)
        async with grpc.aio.insecure_channel(restarted.target) as channel:
            admin = pb_grpc.AdapterAdminStub(channel)
            after = await admin.ListAdapters(pb.ListAdaptersRequest(), metadata=auth())
            assert [(a.name, a.version, a.pinned, a.pin_replicas) for a in after.adapters] == [
                (a.name, a.version, a.pinned, a.pin_replicas) for a in before.adapters]
            since = time.time()

            async def beat_after_restart():
                pods = (await admin.ListPods(pb.ListPodsRequest(), metadata=auth())).pods
                return [p for p in pods if p.id == "pod-a" and p.last_heartbeat > since]

            await eventually(beat_after_restart, 15, "the pod to heartbeat to the restarted control plane")
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)

    asyncio.run(go())


def test_a_redis_crash_under_a_running_control_plane_loses_no_acknowledged_write(start_control_plane, redis_server):
    cp = start_control_plane()

    async def go():
        async with grpc.aio.insecure_channel(cp.target) as channel:
            admin, health = pb_grpc.AdapterAdminStub(channel), health_pb2_grpc.HealthStub(channel)
            await admin.RegisterAdapter(register("a"), metadata=auth())
            await admin.PinAdapter(pb.PinAdapterRequest(name="a", replicas=2), metadata=auth())
            redis_server.kill()

            async def status():
                return (await health.Check(health_pb2.HealthCheckRequest())).status

            await eventually(lambda: _is(status(), health_pb2.HealthCheckResponse.NOT_SERVING), 5, "NOT_SERVING")
            redis_server.start()
            await eventually(lambda: _is(status(), health_pb2.HealthCheckResponse.SERVING), 5, "SERVING again")
            return await admin.GetAdapter(pb.GetAdapterRequest(name="a"), metadata=auth())

    adapter = asyncio.run(go())
    assert (adapter.version, adapter.pinned, adapter.pin_replicas) == (2, True, 2)


def test_a_redis_outage_takes_the_control_plane_out_of_readiness_but_keeps_it_live(start_control_plane, redis_server):
    cp = start_control_plane()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    readiness = ("", *SERVICES)

    async def go():
        async with grpc.aio.insecure_channel(cp.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)).status

            async def statuses() -> dict[str, int]:
                return {name: await status(name) for name in (*readiness, LIVENESS)}

            await eventually(lambda: _is(status(""), serving), 10, "ready with Redis up")
            up = await statuses()
            redis_server.kill()
            await eventually(lambda: _is(status(""), not_serving), 5, "readiness NOT_SERVING")
            during = []
            for _ in range(20):  # 4 s: past the leader lease (1.5 s) and many failed pings and passes
                during.append(await statuses())
                await asyncio.sleep(0.2)
            redis_server.start()
            await eventually(lambda: _is(status(""), serving), 5, "ready again")
            return up, during, await statuses()

    up, during, after = asyncio.run(go())
    assert up == after == {name: serving for name in (*readiness, LIVENESS)}
    assert all(d == {**{name: not_serving for name in readiness}, LIVENESS: serving} for d in during), during
    assert cp.proc.poll() is None


async def _is(value, expected) -> bool:
    return await value == expected


def test_two_replicas_elect_one_leader_and_the_other_takes_over_with_a_higher_fencing_token(
        start_control_plane, redis_server):
    replicas = {"r1": start_control_plane("r1"), "r2": start_control_plane("r2")}

    async def go():
        store = Store(redis_server.url, "it")
        client = membership(replicas["r1"])
        beating = asyncio.create_task(client.run())
        try:
            first = await eventually(store.leader, 10, "a leader to be elected")
            leader, follower = replicas[first[0]], replicas[{"r1": "r2", "r2": "r1"}[first[0]]]
            await asyncio.sleep(1.0)  # several renewals: the lease must not flap
            assert await store.leader() == first
            gauge = "lorafleet_control_plane_leader"
            assert (leader.metric(gauge), follower.metric(gauge)) == (1.0, 0.0)
            await eventually(lambda: client.guard.newest == first[1], 5, "the pod to see the leader's token")

            leader.stop(signal.SIGKILL)
            killed = time.monotonic()

            async def taken_over():
                holder = await store.leader()
                return holder if holder and holder[0] != first[0] else None

            second = await eventually(taken_over, 10, "the surviving replica to take the lease")
            assert time.monotonic() - killed < 1.5 + 2.0  # within the lease TTL plus a renewal period
            assert second[1] > first[1]
            assert follower.metric("lorafleet_control_plane_fencing_token") == second[1]
            return first, second
        finally:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
            await store.close()

    asyncio.run(go())


def test_sigterm_releases_the_lease_so_the_other_replica_takes_over_at_once(start_control_plane, redis_server):
    replicas = {"r1": start_control_plane("r1"), "r2": start_control_plane("r2")}

    async def go():
        store = Store(redis_server.url, "it")
        try:
            first = await eventually(store.leader, 10, "a leader to be elected")
            stopped = time.monotonic()
            assert replicas[first[0]].stop(signal.SIGTERM) == 0

            async def taken_over():
                holder = await store.leader()
                return holder if holder and holder[0] != first[0] else None

            second = await eventually(taken_over, 10, "the other replica to take the lease")
            return first, second, time.monotonic() - stopped
        finally:
            await store.close()

    first, second, took = asyncio.run(go())
    assert second[1] > first[1]
    assert took < 3.0


def test_help_lists_every_flag():
    out = subprocess.run([sys.executable, "-m", "control_plane.server", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=30, env=os.environ | {"COLUMNS": "200"}).stdout
    for flag in ("--redis-url", "--host", "--port", "--metrics-port", "--admin-token-file", "--key-prefix",
                 "--base-model", "--tls-cert", "--tls-key", "--tls-ca", "--health-port"):
        assert flag in out
