"""The registry in a real Redis: versions, compare-and-set, paging, change feed, pods, the
leader lease, and durability across a Redis crash."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis as redis_sync

from control_plane.errors import AdapterExists, AdapterNotFound, InvalidArgument, StoreUnavailable, VersionConflict
from control_plane.records import AdapterRecord, PlacementRecord, PlacementState, PodRecord, Residency
from control_plane.store import Store

SHA = "ab" * 32


def adapter(name: str, sha: str = SHA) -> AdapterRecord:
    return AdapterRecord(name=name, source=f"file:///adapters/{name}", sha256=sha, base_model="m")


def with_store(redis_server, body, prefix: str = "t", clock=None):
    async def go():
        store = Store(redis_server.url, prefix, **({"clock": clock} if clock else {}))
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(go())


def pin(replicas: int):
    return lambda r: dataclasses.replace(r, pinned=True, pin_replicas=replicas)


def test_new_adapter_starts_at_version_one_and_each_change_increments_it(redis_server):
    async def body(store):
        created = await store.create_adapter(adapter("a"))
        pinned = await store.update_adapter("a", pin(2), "pinned")
        unpinned = await store.update_adapter("a", lambda r: dataclasses.replace(r, pinned=False), "unpinned")
        return created.version, pinned.version, unpinned.version, await store.get_adapter("a")

    v1, v2, v3, stored = with_store(redis_server, body)
    assert (v1, v2, v3) == (1, 2, 3)
    assert stored.version == 3 and not stored.pinned


def test_a_change_that_alters_nothing_keeps_the_version(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        await store.update_adapter("a", pin(2), "pinned")
        return await store.update_adapter("a", pin(2), "pinned")

    assert with_store(redis_server, body).version == 2


def test_registering_the_same_adapter_twice_is_idempotent_but_a_different_one_is_refused(redis_server):
    async def body(store):
        first = await store.create_adapter(adapter("a"))
        again = await store.create_adapter(adapter("a"))
        with pytest.raises(AdapterExists, match="other weights.*unregister it first"):
            await store.create_adapter(adapter("a", sha="cd" * 32))
        return first, again, await store.get_adapter("a")

    first, again, stored = with_store(redis_server, body)
    assert first == again == stored


def test_the_same_weights_from_another_source_move_the_adapter_and_keep_its_pin(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        await store.update_adapter("a", pin(2), "pinned")
        moved = await store.create_adapter(dataclasses.replace(adapter("a"), source="file:///elsewhere/a"))
        with pytest.raises(AdapterExists, match="other weights"):
            await store.create_adapter(dataclasses.replace(adapter("a", sha="cd" * 32), source="file:///third/a"))
        return moved, await store.get_adapter("a")

    moved, stored = with_store(redis_server, body)
    assert moved == stored
    assert (stored.source, stored.version, stored.pinned, stored.pin_replicas) == ("file:///elsewhere/a", 3, True, 2)


def test_update_with_a_stale_expected_version_is_refused_and_changes_nothing(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        await store.update_adapter("a", pin(1), "pinned", expected_version=1)
        with pytest.raises(VersionConflict, match="version 2, not 1"):
            await store.update_adapter("a", pin(5), "pinned", expected_version=1)
        with pytest.raises(VersionConflict):
            await store.delete_adapter("a", expected_version=1)
        return await store.get_adapter("a")

    stored = with_store(redis_server, body)
    assert (stored.version, stored.pin_replicas) == (2, 1)


def test_a_write_racing_a_compare_and_set_is_not_lost(redis_server):
    """Another client changes the record between our read and our write; the store must retry
    on the fresh record rather than overwrite the other change."""
    other = redis_sync.Redis.from_url(redis_server.url, decode_responses=True)
    raced = []

    def change(rec):
        if not raced:  # the first attempt races a concurrent pin
            other.hset("t:adapter:a", mapping={"pinned": "1", "pin_replicas": "7", "version": "2"})
            raced.append(True)
        return dataclasses.replace(rec, source="file:///adapters/moved")

    async def body(store):
        await store.create_adapter(adapter("a"))
        return await store.update_adapter("a", change, "moved")

    stored = with_store(redis_server, body)
    assert stored.source == "file:///adapters/moved"
    assert (stored.pinned, stored.pin_replicas, stored.version) == (True, 7, 3)


def test_a_change_raced_on_every_attempt_gives_up_with_store_unavailable_and_writes_nothing(redis_server):
    other = redis_sync.Redis.from_url(redis_server.url, decode_responses=True)
    attempts = []

    def change(rec):
        attempts.append(1)
        other.hset("t:adapter:a", "pin_replicas", str(len(attempts)))  # aborts this attempt's EXEC
        return dataclasses.replace(rec, source="file:///adapters/moved")

    async def body(store):
        await store.create_adapter(adapter("a"))
        with pytest.raises(StoreUnavailable, match="updating 'a' kept conflicting with other writers; retry"):
            await store.update_adapter("a", change, "moved")
        return await store.get_adapter("a")

    stored = with_store(redis_server, body)
    assert len(attempts) == 32
    assert (stored.source, stored.version) == ("file:///adapters/a", 1)


def test_concurrent_updates_each_get_their_own_version(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        results = await asyncio.gather(*(store.update_adapter("a", pin(n), "pinned") for n in range(1, 11)))
        return sorted(r.version for r in results), await store.get_adapter("a")

    versions, stored = with_store(redis_server, body)
    assert versions == list(range(2, 12))
    assert stored.version == 11


def test_missing_adapter_is_not_found_for_every_operation(redis_server):
    async def body(store):
        for op in (store.get_adapter("x"), store.update_adapter("x", pin(1), "pinned"), store.delete_adapter("x")):
            with pytest.raises(AdapterNotFound, match="register it first"):
                await op

    with_store(redis_server, body)


def test_listing_pages_through_every_adapter_once_in_name_order(redis_server):
    names = [f"adapter-{i:02d}" for i in range(23)]

    async def body(store):
        for n in reversed(names):
            await store.create_adapter(adapter(n))
        seen, token, pages = [], "", 0
        while True:
            page, token = await store.list_adapters(5, token)
            seen += [r.name for r in page]
            pages += 1
            if not token:
                return seen, pages

    seen, pages = with_store(redis_server, body)
    assert seen == names
    assert pages == 5


def test_a_page_token_the_server_never_issued_is_invalid(redis_server):
    async def body(store):
        with pytest.raises(InvalidArgument, match="next_page_token"):
            await store.list_adapters(5, "not base64!")

    with_store(redis_server, body)


def test_change_feed_records_every_change_in_order(redis_server):
    async def body(store):
        start = await store.last_event_id()
        await store.create_adapter(adapter("a"))
        await store.update_adapter("a", pin(0), "pinned")
        await store.delete_adapter("a")
        return await store.events(start)

    events = with_store(redis_server, body)
    assert [(e.kind, e.name, e.version) for e in events] == [
        ("registered", "a", 1), ("pinned", "a", 2), ("unregistered", "a", 3)]


def test_unregistering_removes_record_index_and_placements(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        token = await store.acquire_leadership("r1", 5)
        await store.put_placement(PlacementRecord("a", "pod-1", PlacementState.FAILED, "bad sha", 1, 1.0), token)
        await store.delete_adapter("a")
        return await store.list_adapters(10), await store.placements(["a"])

    (page, token), placements = with_store(redis_server, body)
    assert page == [] and token == ""
    assert placements == {"a": []}


def test_keys_stay_under_the_configured_prefix(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        await store.put_pod(PodRecord("p", "127.0.0.1:1", last_heartbeat=1.0))
        await store.acquire_leadership("r1", 5)

    with_store(redis_server, body, prefix="fleet-x")
    keys = redis_sync.Redis.from_url(redis_server.url, decode_responses=True).keys("*")
    assert keys and all(k.startswith("fleet-x:") for k in keys)


def test_pods_silent_past_the_cutoff_are_removed_with_their_placements(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        await store.put_pod(PodRecord("old", "127.0.0.1:1", last_heartbeat=100.0,
                                      residents=(Residency("a", pinned=True),)))
        await store.put_pod(PodRecord("new", "127.0.0.1:2", last_heartbeat=200.0))
        token = await store.acquire_leadership("r1", 5)
        await store.put_placement(PlacementRecord("a", "old", PlacementState.READY), token)
        removed = await store.remove_pods_silent_since(150.0, token)
        return removed, await store.list_pods(), await store.placements(["a"])

    removed, pods, placements = with_store(redis_server, body)
    assert removed == ["old"]
    assert [p.id for p in pods] == ["new"]
    assert placements == {"a": []}


def test_one_pod_is_removed_only_if_no_heartbeat_arrived_after_the_one_its_remover_saw(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        await store.put_pod(PodRecord("p", "127.0.0.1:1", last_heartbeat=100.0))
        await store.put_pod(PodRecord("q", "127.0.0.1:2", last_heartbeat=100.0))
        token = await store.acquire_leadership("r1", 5)
        await store.put_placement(PlacementRecord("a", "p", PlacementState.READY), token)
        await store.put_placement(PlacementRecord("a", "q", PlacementState.READY), token)
        await store.put_pod(PodRecord("p", "127.0.0.1:1", last_heartbeat=101.0))  # p beat again meanwhile
        kept = await store.remove_pod("p", 100.0, token)
        removed = await store.remove_pod("q", 100.0, token)
        return kept, removed, await store.list_pods(), await store.placements(["a"])

    kept, removed, pods, placements = with_store(redis_server, body)
    assert (kept, removed) == (False, True)
    assert [p.id for p in pods] == ["p"]
    assert [r.pod for r in placements["a"]] == ["p"]


def test_pod_record_round_trips_with_its_residents(redis_server):
    pod = PodRecord("p", "10.0.0.1:50051", "m", True, 5.0, 4, 2, 1, 8, 3, 1, 2, 0,
                    (Residency("a", True, 8, SHA, True), Residency("b")), precision="bfloat16-matmul")

    async def body(store):
        await store.put_pod(pod)
        return await store.list_pods()

    assert with_store(redis_server, body) == [pod]


def test_only_one_replica_holds_the_leader_lease_and_renewal_keeps_its_token(redis_server):
    async def body(store):
        first = await store.acquire_leadership("r1", 5)
        other = await store.acquire_leadership("r2", 5)
        renewed = await store.acquire_leadership("r1", 5)
        return first, other, renewed, await store.leader()

    first, other, renewed, holder = with_store(redis_server, body)
    assert first > 0 and other == 0 and renewed == first
    assert holder == ("r1", first)


def test_a_lapsed_lease_goes_to_the_next_replica_with_a_larger_fencing_token(redis_server):
    async def body(store):
        first = await store.acquire_leadership("r1", 0.2)
        await asyncio.sleep(0.3)
        second = await store.acquire_leadership("r2", 5)
        stale_release = await store.release_leadership("r1", first)
        return first, second, stale_release, await store.leader(), await store.fencing_token()

    first, second, stale_release, holder, newest = with_store(redis_server, body)
    assert second > first
    assert not stale_release and holder == ("r2", second)
    assert newest == second


def test_acknowledged_writes_survive_a_redis_crash_and_restart(redis_server):
    async def before(store):
        for i in range(20):
            await store.create_adapter(adapter(f"a{i:02d}"))
        await store.update_adapter("a07", pin(3), "pinned")
        await store.delete_adapter("a13")
        return await store.acquire_leadership("r1", 60)

    async def after(store):
        return await store.all_adapters(), await store.fencing_token(), await store.events()

    token = with_store(redis_server, before)
    redis_server.restart()  # SIGKILL: nothing but the fsynced append-only file survives
    adapters, fencing, events = with_store(redis_server, after)
    assert [a.name for a in adapters] == [f"a{i:02d}" for i in range(20) if i != 13]
    assert next(a for a in adapters if a.name == "a07").pin_replicas == 3
    assert fencing == token
    assert len(events) == 22


def test_an_unreachable_redis_is_reported_as_store_unavailable(redis_server):
    redis_server.kill()

    async def body(store):
        with pytest.raises(StoreUnavailable, match="check --redis-url"):
            await store.get_adapter("a")

    with_store(redis_server, body)


def test_the_pinned_index_follows_pins_unpins_and_unregistrations(redis_server):
    async def body(store):
        for name in ("a", "b", "c"):
            await store.create_adapter(adapter(name))
        await store.update_adapter("a", pin(1), "pinned")
        await store.update_adapter("b", pin(0), "pinned")
        first = [r.name for r in await store.pinned_adapters()]
        await store.update_adapter("a", lambda r: dataclasses.replace(r, pinned=False), "unpinned")
        await store.delete_adapter("b")
        return first, await store.pinned_adapters()

    first, then = with_store(redis_server, body)
    assert first == ["a", "b"]
    assert then == []


def test_rebuilding_the_pinned_index_finds_pins_written_without_it_and_drops_stale_entries(redis_server):
    """A registry written before the index existed (or by an older replica) has pins the index lacks."""
    other = redis_sync.Redis.from_url(redis_server.url, decode_responses=True)

    async def body(store):
        for name in ("a", "b", "c"):
            await store.create_adapter(adapter(name))
        other.hset("t:adapter:b", mapping={"pinned": "1", "pin_replicas": "2"})  # no index entry
        other.sadd("t:pinned", "c")  # an index entry for an adapter that is not pinned
        before = [r.name for r in await store.pinned_adapters()]
        count = await store.index_pins()
        return before, count, await store.pinned_adapters()

    before, count, after = with_store(redis_server, body)
    assert before == []
    assert count == 1
    assert [(r.name, r.pin_replicas) for r in after] == [("b", 2)]


def test_more_concurrent_calls_than_pooled_connections_wait_for_one_instead_of_failing(redis_server):
    async def body(store):
        await store.create_adapter(adapter("a"))
        return await asyncio.gather(*(store.get_adapter("a") for _ in range(300)))

    assert {r.name for r in with_store(redis_server, body)} == {"a"}


def test_recording_a_heartbeat_returns_the_newest_fencing_token(redis_server):
    async def body(store):
        before = await store.put_pod(PodRecord("p", "127.0.0.1:1", last_heartbeat=1.0))
        token = await store.acquire_leadership("r1", 5)
        return before, token, await store.put_pod(PodRecord("p", "127.0.0.1:1", last_heartbeat=2.0))

    before, token, after = with_store(redis_server, body)
    assert (before, after) == (0, token) and token > 0


def test_listing_pods_reuses_known_records_whose_heartbeat_is_unchanged(redis_server):
    """A record read before is not read or decoded again while the pod's heartbeat time is the same;
    a newer heartbeat, a new pod and a removed pod all show."""
    beat = 1_790_000_000.123457  # a fractional wall-clock time: the sorted set's score must equal the JSON's

    async def body(store):
        await store.put_pod(PodRecord("p", "127.0.0.1:1", last_heartbeat=beat))
        await store.put_pod(PodRecord("q", "127.0.0.1:2", last_heartbeat=beat + 0.1))
        known = {p.id: p for p in await store.list_pods()}
        # Rewritten behind the store's back at the same heartbeat time: the known record stands.
        with redis_sync.Redis.from_url(redis_server.url, decode_responses=True) as raw:
            raw.set(store._k("pod", "p"), PodRecord("p", "127.0.0.1:9", last_heartbeat=beat).to_json())
        reused = await store.list_pods(known=known)
        await store.put_pod(PodRecord("q", "127.0.0.1:3", last_heartbeat=beat + 1.1))
        await store.put_pod(PodRecord("r", "127.0.0.1:4", last_heartbeat=beat + 1.1))
        token = await store.acquire_leadership("r1", 5)
        await store.remove_pod("p", beat, token)
        return known, reused, await store.list_pods(known=known)

    known, reused, after = with_store(redis_server, body)
    assert reused[0] is known["p"] and reused[1] is known["q"]
    assert [(p.id, p.endpoint) for p in after] == [("q", "127.0.0.1:3"), ("r", "127.0.0.1:4")]
