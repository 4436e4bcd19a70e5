"""The pod's side of membership: the fencing guard, and behaviour while the control plane is away."""

from __future__ import annotations

import asyncio

import pytest
from lorafleet.v1 import data_plane_admin_pb2 as dpa

from benchmarks.processes import TOKEN, free_port
from data_plane.errors import ControlPlaneUnavailable, StaleCommand
from data_plane.membership import FencingGuard, MembershipClient


def test_fencing_guard_refuses_tokens_older_than_the_newest_seen():
    guard = FencingGuard()
    guard.check(0)  # before any leader, commands without a token pass
    guard.observe(5)
    guard.check(5)
    guard.check(7)
    assert guard.newest == 7
    with pytest.raises(StaleCommand, match="no longer the leader"):
        guard.check(6)
    guard.observe(3)  # an older token from a heartbeat never lowers the bar
    assert guard.newest == 7


def test_resolve_without_a_reachable_control_plane_says_so():
    async def go():
        client = MembershipClient(f"127.0.0.1:{free_port()}", TOKEN, "p", "127.0.0.1:1", "m", dpa.PodState,
                                  rpc_timeout_s=2.0)
        try:
            with pytest.raises(ControlPlaneUnavailable, match="retry later"):
                await client.resolve("a")
        finally:
            await client.close()

    asyncio.run(go())


def test_heartbeats_keep_retrying_with_backoff_while_the_control_plane_is_down():
    async def go():
        calls = []

        def state():
            calls.append(1)
            return dpa.PodState()

        client = MembershipClient(f"127.0.0.1:{free_port()}", TOKEN, "p", "127.0.0.1:1", "m", state,
                                  interval_s=0.05, rpc_timeout_s=0.5, max_backoff_s=0.2)
        task = asyncio.create_task(client.run())
        await asyncio.sleep(1.5)
        assert not task.done()  # failures do not end the loop
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return len(calls)

    attempts = asyncio.run(go())
    assert 3 <= attempts <= 15  # backing off: far fewer than 1.5 s / 0.05 s


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        MembershipClient("127.0.0.1:1", TOKEN, "p", "127.0.0.1:1", "m", dpa.PodState, interval_s=0)


def test_a_heartbeat_carries_the_pods_busiest_adapters_rates_to_the_registry(config):
    from control_plane.store import Store
    from data_plane.demand import DemandMeter
    from tests.control_plane.conftest import serving

    meter = DemandMeter(window_s=10.0)
    for name, count in (("hot", 20), ("warm", 5), ("cool", 1)):
        for _ in range(count):
            meter.record(name)

    async def go():
        async with serving(config):
            client = MembershipClient(f"127.0.0.1:{config.port}", TOKEN, "p", "127.0.0.1:1", "smollm2-135m",
                                      dpa.PodState, demand=meter, demand_report_top=2)
            store = Store(config.redis_url, config.key_prefix)
            try:
                await client.heartbeat()
                return await store.list_pods()
            finally:
                await client.close()
                await store.close()

    (pod,) = asyncio.run(go())
    assert [a for a, _ in pod.demand] == ["hot", "warm"]  # the top two; "cool" only in the summed rest
    assert pod.demand[0][1] == pytest.approx(2.0, rel=0.01)
