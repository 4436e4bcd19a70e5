"""The control-plane process with a small fleet of light simulated pods (benchmarks/light_pods.py: real
DataPlaneAdmin servers and real heartbeats on in-memory caches): every pin is placed on as many pods as
asked, within each pod's capacity, and the registry reports what the pods themselves hold."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc

from benchmarks.light_pods import LightFleet
from benchmarks.processes import BASE_MODEL, TOKEN, ControlPlaneProcess
from control_plane.records import PodRecord
from control_plane.store import Store
from data_plane.demand import DemandMeter
from tests.control_plane.conftest import auth

pytestmark = pytest.mark.slow
SHA = "cd" * 32
PODS, SLOTS, ADAPTERS = 12, 8, 200  # a pod holds SLOTS - 1 pins (one slot stays unpinned)
TWICE = 30  # adapters pinned on two pods each; one more is pinned on every pod


async def listing(admin: pb_grpc.AdapterAdminStub, page_size: int) -> list[pb.Adapter]:
    adapters, token = [], ""
    while True:
        page = await admin.ListAdapters(pb.ListAdaptersRequest(page_size=page_size, page_token=token),
                                        metadata=auth(), timeout=10)
        adapters += page.adapters
        token = page.next_page_token
        if not token:
            return adapters


def pinned_by_pods(fleet: LightFleet) -> dict[str, set[str]]:
    """Adapter -> the pods whose own cache holds it pinned."""
    out: dict[str, set[str]] = {}
    for pod in fleet.pods:
        for name, entry in pod.cache.entries.items():
            if entry.pinned:
                out.setdefault(name, set()).add(pod.pod_id)
    return out


def test_every_pin_is_placed_across_light_pods_and_listed_as_the_pods_hold_it(redis_server, token_file, tmp_path):
    names = [f"ad-{i:03d}" for i in range(ADAPTERS)]
    twice = random.Random(3).sample(names[1:], TWICE)
    everywhere = names[0]

    async def body() -> tuple[dict[str, set[str]], list[pb.Adapter], list[int]]:
        cp = ControlPlaneProcess(redis_server.url, token_file, tmp_path, "cp", lease_s=2.0, grace_s=2.0).start()
        fleet = LightFleet(cp.target, TOKEN, PODS, BASE_MODEL, slots=SLOTS, interval_s=0.3)
        channel = grpc.aio.insecure_channel(cp.target)
        admin = pb_grpc.AdapterAdminStub(channel)
        try:
            await fleet.start()
            for name in names:
                await admin.RegisterAdapter(pb.RegisterAdapterRequest(
                    name=name, source=f"file:///adapters/{name}", sha256=SHA, base_model=BASE_MODEL),
                    metadata=auth(), timeout=10)
            await admin.PinAdapter(pb.PinAdapterRequest(name=everywhere, replicas=0), metadata=auth(), timeout=10)
            for name in twice:
                await admin.PinAdapter(pb.PinAdapterRequest(name=name, replicas=2), metadata=auth(), timeout=10)
            want = {everywhere: PODS, **{n: 2 for n in twice}}
            deadline = time.monotonic() + 60
            while {n: len(p) for n, p in pinned_by_pods(fleet).items()} != want:
                assert time.monotonic() < deadline, f"pins not placed within 60 s: {pinned_by_pods(fleet)}"
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # a few more heartbeats and passes: the placement holds still
            held = pinned_by_pods(fleet)
            pins_per_pod = [sum(e.pinned for e in p.cache.entries.values()) for p in fleet.pods]
            return held, await listing(admin, 7), pins_per_pod
        finally:
            await channel.close()
            await fleet.stop()
            cp.stop()

    held, listed, pins_per_pod = asyncio.run(body())
    assert {n: len(p) for n, p in held.items()} == {everywhere: PODS, **{n: 2 for n in twice}}
    assert max(pins_per_pod) <= SLOTS - 1
    assert [a.name for a in listed] == names  # every adapter once, in name order
    for a in listed:
        ready = {p.pod for p in a.placements if p.state == pb.READY and p.pinned}
        assert ready == held.get(a.name, set()), a.name
        assert a.pinned == (a.name in held)


def test_demand_a_light_pod_reports_gets_a_hot_unpinned_adapter_replicas(redis_server, token_file, tmp_path):
    """The light pods speak the heartbeat's demand report too: a rate above the control plane's
    --replica-high-rate (5 requests/s by default) has the leader load the adapter on more pods, unpinned."""
    async def body() -> list[str]:
        cp = ControlPlaneProcess(redis_server.url, token_file, tmp_path, "cp", lease_s=2.0, grace_s=2.0).start()
        fleet = LightFleet(cp.target, TOKEN, 4, BASE_MODEL, interval_s=0.3)
        fleet.pods[0].demand = DemandMeter(window_s=60.0)
        for _ in range(1200):  # 20 requests/s over the window
            fleet.pods[0].demand.record("hot")
        channel = grpc.aio.insecure_channel(cp.target)
        try:
            await pb_grpc.AdapterAdminStub(channel).RegisterAdapter(pb.RegisterAdapterRequest(
                name="hot", source="file:///adapters/hot", sha256=SHA, base_model=BASE_MODEL),
                metadata=auth(), timeout=10)
            await fleet.start()
            deadline = time.monotonic() + 30
            while len(holders := [p.pod_id for p in fleet.pods if "hot" in p.cache.entries]) < 2:
                assert time.monotonic() < deadline, f"no replicas within 30 s: {holders}"
                await asyncio.sleep(0.2)
            assert not any(p.cache.entries["hot"].pinned for p in fleet.pods if "hot" in p.cache.entries)
            return holders
        finally:
            await channel.close()
            await fleet.stop()
            cp.stop()

    assert len(asyncio.run(body())) >= 2


def test_light_fleet_traffic_is_reported_in_heartbeats_by_popularity(redis_server, token_file, tmp_path):
    """The scale benchmark's traffic (Poisson requests, Zipf popularity, random pods) reaches the control
    plane as a real pod's does: each pod's stored record carries its per-adapter rates, the most popular
    adapter's the highest, and lists what the pod loaded to serve."""
    adapters = [(f"ad-{i:03d}", SHA) for i in range(50)]

    async def body() -> tuple[LightFleet, list[PodRecord]]:
        cp = ControlPlaneProcess(redis_server.url, token_file, tmp_path, "cp", lease_s=2.0, grace_s=2.0).start()
        fleet = LightFleet(cp.target, TOKEN, 4, BASE_MODEL, slots=2, cpu_entries=6, interval_s=0.3)
        store = Store(redis_server.url, "it")
        try:
            await fleet.start()
            traffic = asyncio.create_task(fleet.traffic(adapters, rate=400.0, alpha=1.2, seed=5))
            deadline = time.monotonic() + 30
            while True:
                # Enough requests that the popularity shows through the draw (Zipf 1.2 over 50: the first
                # adapter gets about 2.3x the second's requests; with a few dozen requests seen, the second
                # can come out ahead), counted before the records are read.
                enough = fleet.requests >= 1200
                records = await store.list_pods()
                if enough and len(records) == 4 and all(r.demand for r in records):
                    break
                assert time.monotonic() < deadline, f"no rates reported within 30 s: {records}"
                await asyncio.sleep(0.2)
            await fleet.stop()
            await asyncio.wait_for(traffic, 5)
            return fleet, records
        finally:
            await fleet.stop()
            await store.close()
            cp.stop()

    fleet, records = asyncio.run(body())
    assert fleet.requests > 0
    rates: dict[str, float] = {}
    for record in records:
        for name, rate in record.demand:
            rates[name] = rates.get(name, 0.0) + rate
        assert {r.name for r in record.residents} <= {name for name, _ in adapters}
        assert record.residents, f"pod {record.id} reports nothing loaded"
    assert max(rates, key=rates.get) == "ad-000"


@pytest.mark.parametrize(("adapters", "rate"), [([], 10.0), ([("ad-000", SHA)], 0.0)])
def test_light_fleet_traffic_refuses_no_adapters_or_no_rate(adapters, rate):
    fleet = LightFleet("127.0.0.1:1", TOKEN, 1, BASE_MODEL)
    with pytest.raises(ValueError, match="traffic needs adapters and a rate above 0"):
        asyncio.run(fleet.traffic(adapters, rate=rate, alpha=1.0))
    assert fleet.requests == 0
