"""Fencing of the reconciler's writes, in a real Redis: a write carries the leader's fencing
token, and Redis refuses it, changing nothing, once that token is no longer the lease's."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.errors import NotLeader
from control_plane.records import AdapterRecord, PlacementRecord, PlacementState, PodRecord
from control_plane.store import Store


def with_store(redis_server, body):
    async def go():
        store = Store(redis_server.url, "t")
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(go())


def adapter(name: str) -> AdapterRecord:
    return AdapterRecord(name=name, source=f"file:///adapters/{name}", sha256="ab" * 32, base_model="m")


def test_a_deposed_leaders_placement_write_is_refused_by_redis_and_changes_nothing(redis_server):
    async def body(store):
        deposed = await store.acquire_leadership("r1", 0.2)
        await asyncio.sleep(0.3)  # r1 pauses past its lease; r2 takes over and writes
        current = await store.acquire_leadership("r2", 5)
        await store.put_placement(PlacementRecord("a", "p0", PlacementState.READY, "", 0, 2.0), current)
        with pytest.raises(NotLeader, match=f"fencing token {deposed} is no longer"):
            await store.put_placement(PlacementRecord("a", "p0", PlacementState.FAILED, "late", 3, 3.0), deposed)
        with pytest.raises(NotLeader):
            await store.delete_placement("a", "p0", deposed)
        after_refusals = await store.placements(["a"])
        await store.put_placement(PlacementRecord("a", "p1", PlacementState.LOADING, "", 0, 4.0), current)
        return after_refusals, await store.placements(["a"])

    after_refusals, after_write = with_store(redis_server, body)
    assert after_refusals == {"a": [PlacementRecord("a", "p0", PlacementState.READY, "", 0, 2.0)]}
    assert [(p.pod, p.state) for p in after_write["a"]] == [("p0", PlacementState.READY),
                                                            ("p1", PlacementState.LOADING)]


def test_a_lapsed_lease_fences_every_reconciler_write_even_before_a_successor_takes_it(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        await store.put_pod(PodRecord("old", "127.0.0.1:1", last_heartbeat=100.0))
        token = await store.acquire_leadership("r1", 5)
        await store.put_placement(PlacementRecord("a", "old", PlacementState.READY), token)
        await store.set_pin_status({"a": "asked for 2 pods, pinned on 1"}, token)
        await store.release_leadership("r1", token)  # as if the lease had lapsed
        writes = [store.put_placement(PlacementRecord("a", "old", PlacementState.FAILED), token),
                  store.delete_placement("a", "old", token), store.set_pin_status({}, token),
                  store.remove_pods_silent_since(150.0, token), store.remove_pod("old", 100.0, token)]
        refused = 0
        for write in writes:
            with pytest.raises(NotLeader):
                await write
            refused += 1
        return refused, await store.placements(["a"]), await store.pin_status(["a"]), await store.list_pods()

    refused, placements, status, pods = with_store(redis_server, body)
    assert refused == 5
    assert [(p.pod, p.state) for p in placements["a"]] == [("old", PlacementState.READY)]
    assert status == {"a": "asked for 2 pods, pinned on 1"}
    assert [p.id for p in pods] == ["old"]
